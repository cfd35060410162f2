"""Optimizers and learning-rate schedulers named in a Cerebras config, on torch.

Both config layouts are read:

- 2.3+ trainer: ``trainer.init.optimizer: {AdamW: {lr, betas, eps, weight_decay}}`` and
  ``trainer.init.schedulers: [{LinearLR: {initial_learning_rate, end_learning_rate, total_iters}}]``;
- legacy: ``optimizer: {optimizer_type: adamw, learning_rate: <float | {scheduler: Linear, ...} |
  [...]>, weight_decay(_rate), betas | beta1/beta2, eps, momentum}``.

Schedulers are step functions of ``last_epoch`` (the number of optimizer steps taken), so a resumed
run that restores their state continues with exactly the learning rates of an uninterrupted run.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ckptconv.core.errors import InvalidRequest


class _FunctionLR(LRScheduler):
    """A scheduler whose rate is a function of the step count only."""

    def rate(self, step: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [self.rate(self.last_epoch) for _ in self.optimizer.param_groups]


class ConstantLR(_FunctionLR):
    def __init__(self, optimizer: torch.optim.Optimizer, learning_rate: float, last_epoch: int = -1) -> None:
        self.learning_rate = float(learning_rate)
        super().__init__(optimizer, last_epoch)

    def rate(self, step: int) -> float:
        return self.learning_rate


class LinearLR(_FunctionLR):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        end_learning_rate: float,
        total_iters: int,
        cycle: bool = False,
        last_epoch: int = -1,
    ) -> None:
        self.initial_learning_rate = float(initial_learning_rate)
        self.end_learning_rate = float(end_learning_rate)
        self.total_iters = int(total_iters)
        self.cycle = bool(cycle)
        if self.total_iters <= 0:
            raise InvalidRequest("LinearLR total_iters must be positive")
        super().__init__(optimizer, last_epoch)

    def rate(self, step: int) -> float:
        t = step % self.total_iters if self.cycle else min(step, self.total_iters)
        frac = t / self.total_iters
        return self.initial_learning_rate + (self.end_learning_rate - self.initial_learning_rate) * frac


class CosineDecayLR(_FunctionLR):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        initial_learning_rate: float,
        end_learning_rate: float,
        total_iters: int,
        last_epoch: int = -1,
    ) -> None:
        self.initial_learning_rate = float(initial_learning_rate)
        self.end_learning_rate = float(end_learning_rate)
        self.total_iters = int(total_iters)
        if self.total_iters <= 0:
            raise InvalidRequest("CosineDecayLR total_iters must be positive")
        super().__init__(optimizer, last_epoch)

    def rate(self, step: int) -> float:
        t = min(step, self.total_iters) / self.total_iters
        span = self.initial_learning_rate - self.end_learning_rate
        return self.end_learning_rate + span * 0.5 * (1 + math.cos(math.pi * t))


_SCHEDULERS = {"ConstantLR": ConstantLR, "LinearLR": LinearLR, "CosineDecayLR": CosineDecayLR}
_LEGACY_SCHEDULERS = {"constant": "ConstantLR", "linear": "LinearLR", "cosinedecay": "CosineDecayLR"}
_DECAY_ALIASES = {
    "steps": "total_iters",
    "decay_steps": "total_iters",
    "learning_rate": "initial_learning_rate",
    "base_lr": "initial_learning_rate",
}
_SCHEDULER_ALIASES = {
    "ConstantLR": {"initial_learning_rate": "learning_rate", "base_lr": "learning_rate", "lr": "learning_rate"},
    "LinearLR": _DECAY_ALIASES,
    "CosineDecayLR": _DECAY_ALIASES,
}


def _optimizer_spec(config: dict[str, Any]) -> tuple[str, dict[str, Any], list[dict[str, Any]] | float | None]:
    """(optimizer name, its arguments, scheduler description) from either layout."""
    trainer = config.get("trainer")
    if isinstance(trainer, dict):
        init = trainer.get("init") or {}
        raw = init.get("optimizer")
        if raw is None:
            raise InvalidRequest(
                "the config has no trainer.init.optimizer", hint="add e.g. `optimizer: {AdamW: {lr: 1e-3}}`"
            )
        if not isinstance(raw, dict) or len(raw) != 1:
            raise InvalidRequest("trainer.init.optimizer must be a one-key mapping {Name: {args}}")
        ((name, args),) = raw.items()
        args = dict(args or {})
        schedulers = init.get("schedulers")
        if schedulers is None and "learning_rate" in args:
            schedulers = args.pop("learning_rate")
        return name, args, schedulers
    raw = config.get("optimizer")
    if not isinstance(raw, dict):
        raise InvalidRequest("the config has no `optimizer:` section", hint="add e.g. optimizer_type: AdamW")
    args = dict(raw)
    name = args.pop("optimizer_type", None)
    if name is None:
        raise InvalidRequest("`optimizer.optimizer_type` is missing")
    lr = args.pop("learning_rate", None)
    return str(name), args, lr


def build_optimizer(config: dict[str, Any], params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    name, args, lr_spec = _optimizer_spec(config)
    lr = args.pop("lr", None)
    if lr is None:
        lr = _initial_lr(lr_spec)
    wd = args.pop("weight_decay", args.pop("weight_decay_rate", 0.0))
    key = name.lower()
    if key in ("adamw", "adam"):
        betas = args.pop("betas", None)
        if betas is None:
            betas = (args.pop("beta1", 0.9), args.pop("beta2", 0.999))
        eps = float(args.pop("eps", 1e-6 if key == "adamw" else 1e-8))
        args.pop("correct_bias", None)
        klass = torch.optim.AdamW if key == "adamw" else torch.optim.Adam
        return klass(params, lr=float(lr), betas=tuple(float(b) for b in betas), eps=eps, weight_decay=float(wd or 0.0))
    if key == "sgd":
        return torch.optim.SGD(
            params,
            lr=float(lr),
            momentum=float(args.pop("momentum", 0.0) or 0.0),
            dampening=float(args.pop("dampening", 0.0) or 0.0),
            nesterov=bool(args.pop("nesterov", False)),
            weight_decay=float(wd or 0.0),
        )
    raise InvalidRequest(f"optimizer {name!r} is not simulated", hint="use AdamW, Adam or SGD")


def _initial_lr(spec: Any) -> float:
    if spec is None:
        raise InvalidRequest("no learning rate: set optimizer lr or a scheduler")
    if isinstance(spec, int | float):
        return float(spec)
    items = spec if isinstance(spec, list) else [spec]
    first = items[0]
    if isinstance(first, dict) and len(first) == 1 and isinstance(next(iter(first.values())), dict):
        first = next(iter(first.values()))
    for k in ("initial_learning_rate", "learning_rate", "base_lr", "lr"):
        if isinstance(first, dict) and k in first:
            return float(first[k])
    raise InvalidRequest(f"cannot find the initial learning rate in {spec!r}")


def _scheduler_items(spec: Any) -> list[tuple[str, dict[str, Any]]]:
    if spec is None:
        return []
    if isinstance(spec, int | float):
        return [("ConstantLR", {"learning_rate": float(spec)})]
    items = spec if isinstance(spec, list) else [spec]
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise InvalidRequest(f"scheduler entry {item!r} must be a mapping")
        if "scheduler" in item:  # legacy: {scheduler: Linear, ...}
            args = dict(item)
            kind = str(args.pop("scheduler"))
            name = _LEGACY_SCHEDULERS.get(kind.lower().replace("_", "").replace("lr", "")) or kind
        elif len(item) == 1 and isinstance(next(iter(item.values())), dict | type(None)):
            ((name, args),) = item.items()
            args = dict(args or {})
        else:
            raise InvalidRequest(f"cannot read scheduler entry {item!r}")
        aliases = _SCHEDULER_ALIASES.get(name, {})
        args = {aliases.get(k, k): v for k, v in args.items()}
        out.append((name, args))
    return out


def build_schedulers(config: dict[str, Any], optimizer: torch.optim.Optimizer) -> list[LRScheduler]:
    _, _, spec = _optimizer_spec(config)
    items = _scheduler_items(spec)
    if len(items) > 1:
        raise InvalidRequest("the simulator runs one scheduler; sequential/chained schedules are not simulated")
    out = []
    for name, args in items:
        klass = _SCHEDULERS.get(name)
        if klass is None:
            raise InvalidRequest(f"scheduler {name!r} is not simulated", hint=f"use one of {sorted(_SCHEDULERS)}")
        allowed = set(klass.__init__.__code__.co_varnames[2 : klass.__init__.__code__.co_argcount])
        unknown = set(args) - allowed
        if unknown:
            raise InvalidRequest(f"{name}: unknown argument(s) {sorted(unknown)}")
        out.append(klass(optimizer, **args))
    return out
