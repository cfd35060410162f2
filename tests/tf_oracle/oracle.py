"""TensorFlow as the oracle for ckptconv's TF bundle reader and writer (run with .venv-tf's python).

Usage: ``oracle.py JOB.json``. The job (JSON) may name ``make``, a directory where TensorFlow writes
its own checkpoints; ``make_tf1``, a directory for TF1 ones (a graph trained one step with Adam and
saved by ``tf.compat.v1.train.Saver``, and names a Cerebras checkpoint cannot hold as they are);
``read``, bundle prefixes written by ckptconv that ``tf.train.load_checkpoint`` reads back;
``restore``, prefixes that a TF2 ``tf.train.Checkpoint`` of the test model restores (object graph
and all); ``restore_tf1``, prefixes the TF1 ``Saver`` of the Adam graph restores; and ``result``,
the JSON file for the answers. Each job is one process
because importing TensorFlow takes seconds.

Values travel as JSON: ``{"dtype": TF dtype name, "shape": [...], "hex": raw little-endian bytes}``
for numeric tensors and ``{"dtype": "string", "shape": [...], "strings": [hex, ...]}`` for strings.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf


def describe(value: np.ndarray | bytes, dtype: tf.dtypes.DType) -> dict:
    arr = np.asarray(value)
    if dtype == tf.string:
        flat = [bytes(x).hex() for x in arr.reshape(-1)]
        return {"dtype": "string", "shape": list(arr.shape), "strings": flat}
    return {"dtype": dtype.name, "shape": list(arr.shape), "hex": np.ascontiguousarray(arr).tobytes().hex()}


def dump_checkpoint(prefix: str) -> dict:
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    out = {}
    for name in sorted(dtypes):
        if dtypes[name] == tf.variant:  # TensorFlow-internal state: listed, not compared
            out[name] = {"dtype": "variant", "unsupported": True}
        else:
            out[name] = describe(reader.get_tensor(name), dtypes[name])
    return out


def values() -> dict[str, tf.Tensor]:
    """One tensor per dtype TensorFlow can save, with awkward shapes (0-d, empty, odd sizes)."""
    rng = np.random.default_rng(7)
    out = {
        "f32/matrix": tf.constant(rng.standard_normal((3, 5)).astype(np.float32)),
        "f32/scalar": tf.constant(np.float32(-0.0)),
        "f32/empty": tf.zeros((0, 4), tf.float32),
        "f64": tf.constant(rng.standard_normal(3)),
        "f16": tf.constant(rng.standard_normal((2, 3)).astype(np.float16)),
        "bf16": tf.cast(tf.constant(rng.standard_normal((4,)).astype(np.float32)), tf.bfloat16),
        "i8": tf.constant(np.array([-128, 0, 127], np.int8)),
        "u8": tf.constant(np.array([0, 255, 7], np.uint8)),
        "i16": tf.constant(np.array([-32768, 32767], np.int16)),
        "u16": tf.constant(np.array([0, 65535], np.uint16)),
        "i32": tf.constant(np.array([[1, -2], [3, 2**31 - 1]], np.int32)),
        "u32": tf.constant(np.array([2**32 - 1], np.uint32)),
        "i64": tf.constant(np.array([-(2**63), 2**63 - 1], np.int64)),
        "u64": tf.constant(np.array([2**64 - 1], np.uint64)),
        "bool": tf.constant([True, False, True]),
        "c64": tf.constant(np.array([1 + 2j], np.complex64)),
        "str/scalar": tf.constant(b"hello \xff\x00 world"),
        "str/matrix": tf.constant([[b"a", b""], [b"ccc", "h\u00e9".encode()]]),
        "str/empty": tf.zeros((0,), tf.string),
        "unicode/na\u00efve key": tf.constant(1.5),
    }
    return out


def build_model(blank: bool = False) -> tf.Module:
    """The TF2 model of the object-based checkpoints; ``blank`` gives zeros of the same structure."""
    vals = values()

    def init(t: tf.Tensor) -> tf.Variable:
        return tf.Variable(tf.zeros_like(t) if blank else t)

    class Dense(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kernel = init(vals["f32/matrix"])
            self.bias = init(tf.cast(tf.range(5), tf.bfloat16))
            self.half = init(vals["f16"])

    model = tf.Module()
    model.dense = Dense()
    model.step = init(tf.constant(42, tf.int64))
    model.flags = init(vals["bool"])
    model.count = init(vals["i32"])
    model.label = init(vals["str/scalar"])
    return model


def restore(prefix: str) -> dict:
    """Restore a blank model from ``prefix`` the TF2 way (object graph, every value consumed)."""
    model = build_model(blank=True)
    tf.train.Checkpoint(model=model).read(prefix).assert_consumed()
    return {v.name: describe(v.numpy(), v.dtype) for v in model.variables}


ODD_NAMES = ["/lead", "trail/", "a//b", "./x", "a/./b", "a/../b", "%/%value", "a", "a/b", "a/b/c", "sp ace/\u00e9"]


def tf1_graph() -> tuple[tf.Graph, object, object]:
    """Two dense layers trained with Adam, the TF1 way (graph, variable scopes, slots beside each variable)."""
    g = tf.Graph()
    v1 = tf.compat.v1
    with g.as_default():
        v1.set_random_seed(3)
        x = v1.constant(np.arange(12, dtype=np.float32).reshape(4, 3) / 10)
        h = x
        for i, width in enumerate((5, 2)):
            with v1.variable_scope(f"layer_{i}/dense"):
                kernel = v1.get_variable("kernel", [h.shape[1], width], initializer=v1.glorot_uniform_initializer())
                bias = v1.get_variable("bias", [width], initializer=v1.zeros_initializer())
            h = tf.nn.relu(tf.matmul(h, kernel) + bias)
        step = v1.train.get_or_create_global_step()
        train = v1.train.AdamOptimizer(0.1).minimize(tf.reduce_sum(h * h) + 1.0, global_step=step)
        saver = v1.train.Saver()
    return g, train, saver


def tf1_variables(sess: object, g: tf.Graph) -> dict:
    with g.as_default():
        return {v.op.name: describe(sess.run(v), v.dtype.base_dtype) for v in tf.compat.v1.global_variables()}


def restore_tf1(prefix: str) -> dict:
    g, _, saver = tf1_graph()
    with tf.compat.v1.Session(graph=g) as sess:
        saver.restore(sess, prefix)
        return tf1_variables(sess, g)


def make_tf1(out_dir: str) -> dict:
    expected: dict[str, dict] = {}
    g, train, saver = tf1_graph()
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train)
        prefix = saver.save(sess, os.path.join(out_dir, "adam", "model.ckpt"), global_step=1)
        variables = tf1_variables(sess, g)
    expected["adam"] = {"prefix": prefix, "tensors": dump_checkpoint(prefix), "variables": variables}

    odd = os.path.join(out_dir, "odd", "ckpt")
    tensors = [tf.constant(np.arange(i + 1, dtype=np.float32)) for i in range(len(ODD_NAMES))]
    tf.raw_ops.SaveV2(prefix=odd, tensor_names=ODD_NAMES, shape_and_slices=[""] * len(ODD_NAMES), tensors=tensors)
    expected["odd"] = {"prefix": odd, "tensors": dump_checkpoint(odd)}

    int8 = os.path.join(out_dir, "int8", "ckpt")
    tf.raw_ops.SaveV2(prefix=int8, tensor_names=["q/w"], shape_and_slices=[""], tensors=[tf.constant([1, -2], tf.int8)])
    expected["int8"] = {"prefix": int8, "tensors": dump_checkpoint(int8)}
    return expected


def make(out_dir: str) -> dict:
    expected: dict[str, dict] = {}
    vals = values()

    # 1. A TF2 object-based checkpoint: nested trackables give names with slashes and the
    #    _CHECKPOINTABLE_OBJECT_GRAPH string tensor.
    model = build_model()
    ckpt = tf.train.Checkpoint(model=model)
    prefix = ckpt.write(os.path.join(out_dir, "tf2", "ckpt"))
    expected["tf2"] = {"prefix": prefix, "tensors": dump_checkpoint(prefix), "restored": restore(prefix)}

    # 2. The same, sharded by TensorFlow's own size policy (several data files).
    sharded = None
    policy = getattr(getattr(tf.train, "experimental", None), "MaxShardSizePolicy", None)
    if policy is not None:
        opts = tf.train.CheckpointOptions(experimental_sharding_callback=policy(max_shard_size=64))
        sharded = ckpt.write(os.path.join(out_dir, "tf2_sharded", "ckpt"), options=opts)
        expected["tf2_sharded"] = {"prefix": sharded, "tensors": dump_checkpoint(sharded)}

    # 3. Every dtype through the raw save op (names chosen freely, as a TF1 Saver would).
    raw = os.path.join(out_dir, "raw", "all")
    names = list(vals)
    tf.raw_ops.SaveV2(prefix=raw, tensor_names=names, shape_and_slices=[""] * len(names), tensors=list(vals.values()))
    expected["raw"] = {"prefix": raw, "tensors": dump_checkpoint(raw)}

    # 4. Two bundles merged into one with two data shards (what a TF1 sharded Saver does).
    parts = [os.path.join(out_dir, "merge", f"part{i}") for i in range(2)]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    for p, ns in zip(parts, halves, strict=True):
        tf.raw_ops.SaveV2(prefix=p, tensor_names=ns, shape_and_slices=[""] * len(ns), tensors=[vals[n] for n in ns])
    merged = os.path.join(out_dir, "merge", "merged")
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=merged)
    expected["merged"] = {"prefix": merged, "tensors": dump_checkpoint(merged)}

    # 5. Partitioned variables (TF1 Saver slices): three slices of a (7, 3) tensor, a 1-d one split
    #    in two, and one long enough that slice offsets need multi-byte ordered-code numbers.
    full = np.arange(21, dtype=np.float32).reshape(7, 3)
    vec = np.arange(5, dtype=np.int64) * -3
    long = np.arange(20000, dtype=np.int16).reshape(10000, 2)
    part = os.path.join(out_dir, "sliced", "ckpt")
    tf.raw_ops.SaveV2(
        prefix=part,
        tensor_names=["part/w", "part/w", "part/w", "part/v", "part/v", "part/long", "part/long", "plain"],
        shape_and_slices=[
            "7 3 0,2:-",
            "7 3 2,4:-",
            "7 3 6,1:-",
            "5 0,3",
            "5 3,2",
            "10000 2 0,100:-",
            "10000 2 100,9900:-",
            "",
        ],
        tensors=[
            tf.constant(full[0:2]),
            tf.constant(full[2:6]),
            tf.constant(full[6:7]),
            tf.constant(vec[0:3]),
            tf.constant(vec[3:5]),
            tf.constant(long[0:100]),
            tf.constant(long[100:]),
            tf.constant(1.0),
        ],
    )
    expected["sliced"] = {"prefix": part, "tensors": dump_checkpoint(part)}

    # 6. A dataset iterator beside a variable: its state is a DT_VARIANT tensor.
    it = iter(tf.data.Dataset.range(10))
    next(it)
    prefix = tf.train.Checkpoint(it=it, v=tf.Variable([1.0, 2.0])).write(os.path.join(out_dir, "iterator", "ckpt"))
    expected["iterator"] = {"prefix": prefix, "tensors": dump_checkpoint(prefix)}
    return expected


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = {"tensorflow": tf.__version__}
    if job.get("make"):
        os.makedirs(job["make"], exist_ok=True)
        result["made"] = make(job["make"])
    if job.get("make_tf1"):
        os.makedirs(job["make_tf1"], exist_ok=True)
        result["made_tf1"] = make_tf1(job["make_tf1"])
    result["read"] = {}
    for prefix in job.get("read", []):
        try:
            result["read"][prefix] = {"tensors": dump_checkpoint(prefix)}
        except Exception as e:  # reported per bundle so one failure does not hide the others
            result["read"][prefix] = {"error": f"{type(e).__name__}: {e}"}
    result["restored"] = {}
    for prefix in job.get("restore", []):
        try:
            result["restored"][prefix] = restore(prefix)
        except Exception as e:
            result["restored"][prefix] = {"error": f"{type(e).__name__}: {e}"}
    result["restored_tf1"] = {}
    for prefix in job.get("restore_tf1", []):
        try:
            result["restored_tf1"][prefix] = restore_tf1(prefix)
        except Exception as e:
            result["restored_tf1"][prefix] = {"error": f"{type(e).__name__}: {e}"}
    with open(job["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
