"""A tiny, safe expression language for layout tables.

Tables say things like ``groups: "num_heads // kv_groups"`` or ``when: "gated and not headless"``.
Expressions are parsed with :mod:`ast` and only a whitelist of node kinds is evaluated: names,
constants, arithmetic, comparisons, boolean logic, conditional expressions, lists and calls of a
few pure functions. Nothing from the table can reach Python attributes, imports or builtins, so a
table is data, not code.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from ckptconv.core.errors import ConfigConversionError

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CMPOPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_FUNCS = {
    "int": int,
    "float": float,
    "min": min,
    "max": max,
    "abs": abs,
    "sqrt": math.sqrt,
    "log2": math.log2,
    "bool": bool,
}
_ALLOWED = (
    ast.Expression,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.BinOp,
    ast.UnaryOp,
    ast.USub,
    ast.UAdd,
    ast.Not,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.Compare,
    ast.IfExp,
    ast.Call,
    ast.List,
    ast.Tuple,
    *_BINOPS,
    *_CMPOPS,
)


class ExprError(ValueError):
    """A malformed table expression: a bug in a table, caught when the table loads."""


@lru_cache(maxsize=4096)
def compile_expr(text: str) -> ast.Expression:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"bad expression {text!r}: {e.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ExprError(f"expression {text!r} uses {type(node).__name__}, which tables may not use")
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name) or (node.func.id not in _FUNCS and node.func.id != "get")
        ):
            raise ExprError(f"expression {text!r} calls something other than get, {', '.join(_FUNCS)}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "get"
            and (len(node.args) != 2 or not isinstance(node.args[0], ast.Constant))
        ):
            raise ExprError(f"expression {text!r}: get takes a quoted name and a default: get('key', 0)")
        if isinstance(node, ast.Call) and node.keywords:
            raise ExprError(f"expression {text!r}: keyword arguments are not allowed")
    return tree


def names_in(text: str) -> set[str]:
    """The variable names an expression reads (for validating tables on load)."""
    tree = compile_expr(text)
    funcs = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    optional = {
        n.args[0].value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "get"
    }
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - funcs) | optional


def evaluate(expr: Any, env: Mapping[str, Any]) -> Any:
    """Evaluate ``expr``: strings are expressions, other values (numbers, bools, lists) are literal."""
    if isinstance(expr, list):
        return [evaluate(e, env) for e in expr]
    if isinstance(expr, dict):
        return {k: evaluate(v, env) for k, v in expr.items()}
    if not isinstance(expr, str):
        return expr
    return _eval(compile_expr(expr).body, env, expr)


def _eval(node: ast.AST, env: Mapping[str, Any], text: str) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in ("true", "True"):
            return True
        if node.id in ("false", "False"):
            return False
        if node.id in ("null", "None"):
            return None
        if node.id not in env:
            raise ConfigConversionError(
                f"the model config does not say {node.id!r}, which is needed to evaluate {text!r}",
                hint=f"add {node.id} to the model config",
            )
        return env[node.id]
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](_eval(node.left, env, text), _eval(node.right, env, text))
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, env, text)
        if isinstance(node.op, ast.Not):
            return not v
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            result: Any = True
            for v in node.values:
                result = _eval(v, env, text)
                if not result:
                    return result
            return result
        result = False
        for v in node.values:
            result = _eval(v, env, text)
            if result:
                return result
        return result
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env, text)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _eval(comp, env, text)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _eval(node.test, env, text) else node.orelse, env, text)
    if isinstance(node, ast.List | ast.Tuple):
        return [_eval(e, env, text) for e in node.elts]
    if isinstance(node, ast.Call):
        if node.func.id == "get":  # type: ignore[attr-defined]
            # get('key', default): an optional config key (validated at compile time).
            name = node.args[0].value  # type: ignore[attr-defined]
            return env[name] if name in env else _eval(node.args[1], env, text)
        fn = _FUNCS[node.func.id]  # type: ignore[attr-defined]
        return fn(*(_eval(a, env, text) for a in node.args))
    raise ExprError(f"cannot evaluate {type(node).__name__} in {text!r}")
