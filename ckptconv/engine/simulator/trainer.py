"""``simulate``: train a few steps on CPU and write checkpoints the way the appliance's trainer does.

Data is synthetic and deterministic: sample ``i`` of the stream is drawn from a generator seeded by
``(seed, i)``, so a batch depends only on how many samples were streamed before it. Dropout draws
from a generator re-seeded at every global step. A run stopped after any checkpoint and resumed
with ``autoload_last_checkpoint`` therefore reaches bit-identical weights to an uninterrupted run:
model, optimizer, scheduler, global step and dataloader position all come back from the checkpoint.

Checkpoints hold ``model`` (keys prefixed ``model.``, as the trainer's model wrapper names them),
``optimizer``, ``schedulers``, ``global_step``, ``dataloader`` (``{"samples_streamed": n,
"__version__": 1}``) and ``__metadata__`` (``[{"version", "model_name", "params"}]``), written as
Cerebras H5 through the format layer to a local directory or ``s3://``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch
import torch.nn.functional as F

from ckptconv.core.errors import Cancelled, InvalidRequest, TargetExists
from ckptconv.core.fencing import current_attempt, fence
from ckptconv.core.uri import basename
from ckptconv.engine.cs_yaml import read_cs_yaml
from ckptconv.engine.simulator import config as cfg
from ckptconv.engine.simulator.checkpoint_io import open_checkpoint, read_checkpoint, top_level_keys, write_checkpoint
from ckptconv.engine.simulator.checkpoint_policy import (
    CheckpointIndex,
    Policy,
    checkpoint_uri,
    latest_checkpoint,
    parse_policy,
    should_save,
)
from ckptconv.engine.simulator.loading import WRAPPER_PREFIX, check_release, load_model_state, read_metadata
from ckptconv.engine.simulator.models import build_model
from ckptconv.engine.simulator.optim import build_optimizer, build_schedulers
from ckptconv.engine.staging import attempt_staging, discard_staging
from ckptconv.storage import open_storage

SIMULATED_RELEASE = "2.10.0"
# Below this many parameters one intra-op thread is faster: the matmuls are too small to split, and
# on a shared machine extra threads mostly wait for each other.
SMALL_MODEL_PARAMS = 5_000_000
DATALOADER_STATE_VERSION = 1
_MIX = 1_000_003


def _train_section(config: Mapping[str, Any]) -> dict[str, Any]:
    trainer = config.get("trainer")
    if isinstance(trainer, dict):
        fit = trainer.get("fit") or {}
        return dict(fit.get("train_dataloader") or {})
    return dict(config.get("train_input") or {})


def _loop_section(config: Mapping[str, Any]) -> dict[str, Any]:
    trainer = config.get("trainer")
    if isinstance(trainer, dict):
        return dict((trainer.get("init") or {}).get("loop") or {})
    run = config.get("runconfig") or {}
    return {k: run[k] for k in ("max_steps", "num_steps") if k in run}


def _init_value(config: Mapping[str, Any], key: str) -> Any:
    trainer = config.get("trainer")
    if isinstance(trainer, dict):
        return (trainer.get("init") or {}).get(key)
    return (config.get("runconfig") or {}).get(key)


class SyntheticData:
    """Deterministic token streams; sample ``i`` depends only on ``(seed, i)``."""

    def __init__(self, model_cfg: cfg.CsModelConfig, *, batch_size: int, seq_len: int, seed: int) -> None:
        p = model_cfg.params
        self.kind = model_cfg.class_name
        self.batch_size = batch_size
        self.seed = seed
        if self.kind == cfg.T5:
            self.vocab = int(p["src_vocab_size"])
            self.tgt_vocab = int(p["tgt_vocab_size"])
            self.seq = min(seq_len, int(p["src_max_position_embeddings"]), int(p["tgt_max_position_embeddings"]))
        else:
            self.vocab = int(p["vocab_size"])
            max_pos = p.get("max_position_embeddings")
            self.seq = min(seq_len, int(max_pos)) if max_pos else seq_len
        self.num_labels = {
            cfg.BERT: int(p.get("num_classes", 2) or 2),
            cfg.BERT_SEQ: int(p.get("num_labels", 2) or 2),
            cfg.BERT_TOKEN: int(p.get("num_classes", 2) or 2),
        }.get(self.kind, 2)
        self.pad = p.get("pad_token_id") if p.get("mask_padding_in_positional_embed") else None

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * _MIX + index)
        ids = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
        if self.pad is not None:
            ids[ids == self.pad] = (self.pad + 1) % self.vocab
        out = {"input_ids": ids[:-1], "labels": ids[1:]}
        if self.kind == cfg.T5:
            out["decoder_input_ids"] = torch.randint(0, self.tgt_vocab, (self.seq,), generator=g)
            out["labels"] = torch.randint(0, self.tgt_vocab, (self.seq,), generator=g)
        elif self.kind in (cfg.BERT, cfg.BERT_TOKEN):
            out["labels"] = torch.randint(
                0, self.vocab if self.kind == cfg.BERT else self.num_labels, (self.seq,), generator=g
            )
            out["class_labels"] = torch.randint(0, self.num_labels, (), generator=g)
        elif self.kind == cfg.BERT_SEQ:
            out["class_labels"] = torch.randint(0, self.num_labels, (), generator=g)
        elif self.kind == cfg.BERT_QA:
            out["start"] = torch.randint(0, self.seq, (), generator=g)
            out["end"] = torch.randint(0, self.seq, (), generator=g)
        return out

    def batch(self, first_sample: int) -> dict[str, torch.Tensor]:
        samples = [self.sample(first_sample + i) for i in range(self.batch_size)]
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def compute_loss(model: torch.nn.Module, kind: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    if kind in (cfg.GPT2, cfg.GPTJ):
        logits = model(ids)
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    if kind == cfg.T5:
        logits = model(ids, batch["decoder_input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    segments = torch.zeros_like(ids) if model.config.params.get("num_segments") else None
    out = model(ids, segments)
    if kind == cfg.BERT:
        loss = F.cross_entropy(out["mlm_logits"].flatten(0, 1), batch["labels"].flatten())
        if "nsp_logits" in out:
            loss = loss + F.cross_entropy(out["nsp_logits"], batch["class_labels"])
        return loss
    if kind == cfg.BERT_SEQ:
        return F.cross_entropy(out["logits"], batch["class_labels"])
    if kind == cfg.BERT_TOKEN:
        return F.cross_entropy(out["logits"].flatten(0, 1), batch["labels"].flatten())
    return (F.cross_entropy(out["start_logits"], batch["start"]) + F.cross_entropy(out["end_logits"], batch["end"])) / 2


class _Run:
    """One ``simulate`` invocation: the trainer's state and its checkpoint callbacks."""

    def __init__(
        self,
        config: dict[str, Any],
        model_cfg: cfg.CsModelConfig,
        policy: Policy,
        model_dir: str,
        *,
        release: str,
        now: Callable[[], datetime],
    ) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.policy = policy
        self.model_dir = model_dir
        self.root = policy.checkpoint.checkpoint_root or model_dir
        self.root_storage = open_storage(self.root)
        self.release = release
        self.now = now
        self.index = CheckpointIndex(model_dir)
        self.saved: list[str] = []
        self.state_files: list[str] = []
        self.deleted: list[str] = []
        self.keep_fifo: list[str] = []
        self.state_counts = [0] * len(policy.save_states)
        self.warnings: list[str] = []
        # Under a worker: the attempt this run is. Its writes are staged under its own number and
        # published only while it still owns the job (see ckptconv.core.fencing).
        self.attempt = current_attempt()
        self.staging = attempt_staging(self.root_storage, self.root, self.attempt.job_id) if self.attempt else None

    def clear_predecessors(self) -> None:
        """A takeover removes what the job's earlier attempts left staged (a killed worker's files)."""
        if self.attempt is not None:
            fence()
            discard_staging(self.root_storage.join(self.root, "checkpoint"), self.attempt.job_id)

    def clear_staging(self) -> None:
        """This attempt's own staging only: a newer attempt may be using the job's other ones."""
        if self.staging is not None and self.attempt is not None:
            discard_staging(self.root_storage.join(self.root, "checkpoint"), self.attempt.job_id, self.staging)

    def _write(self, name: Callable[[], str], state: dict[str, Any]) -> str:
        """Write ``state`` as a checkpoint at ``name()``; returns its URI.

        Under a worker the file is written into this attempt's staging and published create-only,
        after the fence: an attempt that lost its job stops with LeaseLost before anything of it
        appears, and nothing is ever written over. A checkpoint name taken meanwhile (the last
        write of a stale attempt that passed its fence just before the takeover) is chosen again,
        which gives it the timestamp suffix; a state file's name is fixed and fails TargetExists.
        """
        uri = name()
        if self.staging is None:
            write_checkpoint(uri, state, cstorch_version=self.release)
            return uri
        staged = self.root_storage.join(self.staging, basename(uri))
        write_checkpoint(staged, state, cstorch_version=self.release)
        try:
            for _ in range(2):
                fence()
                try:
                    self.root_storage.publish([(staged, uri)])
                    return uri
                except TargetExists:
                    if name() == uri:
                        raise
                    uri = name()
            raise TargetExists(f"{uri} already exists")
        except BaseException:
            self.root_storage.delete(staged)
            raise

    def _fenced_index(self, change: Callable[[str], None], uri: str) -> None:
        fence()  # a stale attempt must not rewrite the index the job's new owner keeps
        change(uri)

    def state_dict(self, model, optimizer, schedulers, global_step: int, samples: int) -> dict[str, Any]:
        return {
            "model": {WRAPPER_PREFIX + k: v for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "schedulers": [s.state_dict() for s in schedulers],
            "global_step": global_step,
            "dataloader": {"samples_streamed": samples, "__version__": DATALOADER_STATE_VERSION},
            "__metadata__": [{"version": self.release, "model_name": self.model_cfg.class_name, "params": self.config}],
        }

    def save(self, state: dict[str, Any], step: int, *, last_step: bool) -> str:
        uri = self._write(
            lambda: checkpoint_uri(self.root_storage, self.root, self.policy.checkpoint, step, self.now()), state
        )
        self.saved.append(uri)
        self._fenced_index(self.index.append, uri)  # Checkpoint.on_after_save_checkpoint
        keep = self.policy.keep
        if keep is not None and keep.n is not None:
            self.keep_fifo.append(uri)
            if len(self.keep_fifo) > keep.n:
                old = self.keep_fifo.pop(0)
                fence()
                open_storage(old).delete(old)
                self._fenced_index(self.index.remove, old)
                self.deleted.append(old)
        for i, cb in enumerate(self.policy.save_states):
            self.state_counts[i] += 1
            if self.state_counts[i] >= cb.k or last_step:
                self._save_states(cb, uri)
                self.state_counts[i] = 0
        return uri

    def _save_states(self, cb, ckpt_uri: str) -> None:
        source = open_checkpoint(ckpt_uri)
        try:
            keys = cb.select(list(top_level_keys(source)))
            subset = read_checkpoint(source, keys)
        finally:
            source.close()
        uri = self._write(lambda: self.root_storage.join(self.root, cb.file_name(ckpt_uri)), subset)
        self.state_files.append(uri)


def simulate(
    config: str | Mapping[str, Any],
    model_dir: str,
    steps: int | None = None,
    *,
    model: str | None = None,
    ckpt_path: str | None = None,
    checkpoint_steps: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    seed: int | None = None,
    stop_after: int | None = None,
    release: str = SIMULATED_RELEASE,
    now: Callable[[], datetime] = datetime.now,
    on_step: Callable[[int, int, int], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Train until global step ``steps`` (the loop's ``max_steps``) and save checkpoints by policy.

    ``ckpt_path`` loads a checkpoint explicitly; otherwise, with ``autoload_last_checkpoint``, the
    most recent checkpoint of ``model_dir`` is loaded. ``stop_after`` ends the run after that many
    steps of this invocation without the final-step save, as if the job had been killed.
    ``on_step(global_step, start_step, max_steps)`` reports each step; ``cancelled()`` is asked
    before each one and, when true, stops the run with :class:`Cancelled`. Checkpoints already
    saved stay (each is complete and indexed), as an interrupted appliance run leaves them.
    """
    config_doc = read_cs_yaml(config) if isinstance(config, str) else dict(config)
    model_cfg = cfg.parse_model_config(config_doc, model)
    loop = _loop_section(config_doc)
    max_steps = steps if steps is not None else loop.get("max_steps")
    if max_steps is None:
        raise InvalidRequest("how many steps? pass --steps or set trainer.init.loop.max_steps / runconfig.max_steps")
    max_steps = int(max_steps)
    train = _train_section(config_doc)
    batch = int(batch_size or train.get("batch_size") or 2)
    seq = int(seq_len or train.get("max_sequence_length") or 16)
    run_seed = int(seed if seed is not None else (_init_value(config_doc, "seed") or 0))
    policy = parse_policy(config_doc, {"steps": checkpoint_steps})
    run = _Run(config_doc, model_cfg, policy, model_dir, release=release, now=now)
    started = time.perf_counter()
    try:
        run.clear_predecessors()
        hooks = _Hooks(on_step, cancelled)
        result = _train(run, model_cfg, config_doc, max_steps, batch, seq, run_seed, ckpt_path, stop_after, hooks)
    finally:
        run.clear_staging()
        run.index.release_lock_file()
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


@dataclass
class _Hooks:
    on_step: Callable[[int, int, int], None] | None = None
    cancelled: Callable[[], bool] | None = None


def _train(
    run: _Run, model_cfg, config_doc, max_steps, batch, seq, seed, ckpt_path, stop_after, hooks: _Hooks
) -> dict[str, Any]:
    model = build_model(model_cfg, seed=seed)
    threads = torch.get_num_threads()
    if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)
    try:
        return _train_model(
            run, model, model_cfg, config_doc, max_steps, batch, seq, seed, ckpt_path, stop_after, hooks
        )
    finally:
        torch.set_num_threads(threads)


def _train_model(
    run, model, model_cfg, config_doc, max_steps, batch, seq, seed, ckpt_path, stop_after, hooks: _Hooks
) -> dict[str, Any]:
    settings = run.policy.checkpoint
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(config_doc, params)
    schedulers = build_schedulers(config_doc, optimizer)
    global_step = 0
    samples = 0
    loaded_from = None
    load_report = None
    if ckpt_path is None and settings.autoload_last_checkpoint:
        run.index.seed_from_directory(settings)
        ckpt_path = latest_checkpoint(run.index, settings)
    if ckpt_path is not None:
        loaded_from = ckpt_path
        source = open_checkpoint(ckpt_path)
        try:
            warning = check_release(read_metadata(source), run.release, strict_version=settings.strict_version)
            if warning:
                run.warnings.append(warning)
            keys = run.policy.load_states.select(list(top_level_keys(source)))
            if "model" in keys:
                load_report = load_model_state(
                    model, source, strict=not settings.disable_strict_checkpoint_loading
                ).to_dict()
            rest = read_checkpoint(source, [k for k in keys if k != "model"])
        finally:
            source.close()
        if "optimizer" in rest:
            optimizer.load_state_dict(rest["optimizer"])
        sched_states = rest.get("schedulers")
        if "lr_scheduler" in rest:
            if sched_states is not None:
                raise InvalidRequest("the checkpoint holds both `schedulers` and `lr_scheduler`")
            sched_states = [rest["lr_scheduler"]]
        if sched_states is not None:
            if len(sched_states) != len(schedulers):
                raise InvalidRequest(
                    f"the checkpoint has {len(sched_states)} scheduler state(s), the config {len(schedulers)}"
                )
            for s, st in zip(schedulers, sched_states, strict=True):
                s.load_state_dict(st)
        if "global_step" in rest:
            global_step = int(rest["global_step"])
        if isinstance(rest.get("dataloader"), dict):
            samples = int(rest["dataloader"].get("samples_streamed", 0))
    start = global_step
    data = SyntheticData(model_cfg, batch_size=batch, seq_len=seq, seed=seed)

    def snapshot() -> dict[str, Any]:
        return run.state_dict(model, optimizer, schedulers, global_step, samples)

    if settings.save_initial_checkpoint:
        # Saved before the first batch, so it is never "the last step" for SaveCheckpointState.
        run.save(snapshot(), global_step, last_step=False)
    losses: list[float] = []
    interrupted = False
    model.train()
    done = 0
    while global_step < max_steps:
        if stop_after is not None and done >= stop_after:
            interrupted = True
            break
        if hooks.cancelled is not None and hooks.cancelled():
            raise Cancelled(
                f"cancelled by request at global step {global_step}",
                hint=f"checkpoints saved before it stay in {run.model_dir}; autoload resumes from the latest",
            )
        batch_data = data.batch(samples)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * _MIX + global_step)  # dropout masks depend on the step only
            loss = compute_loss(model, model_cfg.class_name, batch_data)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()
        for s in schedulers:
            s.step()
        global_step += 1
        samples += batch
        done += 1
        losses.append(float(loss.detach()))
        if should_save(global_step, start=start, end=max_steps, steps=settings.steps):
            run.save(snapshot(), global_step, last_step=global_step == max_steps)
        if hooks.on_step is not None:
            hooks.on_step(global_step, start, max_steps)
    return {
        "model": model_cfg.model,
        "cs_class": model_cfg.class_name,
        "model_dir": run.model_dir,
        "checkpoint_root": run.root,
        "loaded_from": loaded_from,
        "load": load_report,
        "start_step": start,
        "global_step": global_step,
        "max_steps": max_steps,
        "interrupted": interrupted,
        "samples_streamed": samples,
        "batch_size": batch,
        "sequence_length": data.seq,
        "losses": losses,
        "checkpoints": run.saved,
        "state_checkpoints": run.state_files,
        "deleted": run.deleted,
        "index": run.index.list(),
        "warnings": run.warnings,
        "ignored_config_keys": list(model_cfg.ignored),
    }
