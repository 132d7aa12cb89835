"""Decoding linears through prepacked oneDNN weights on the CPU.

Why: at decode sizes (a few rows per step) the default CPU matmul (MKL sgemm) repacks each weight
on every call, so a batch-8 decode step of the bundled model ran its linears at ~6 GB/s of a ~30
GB/s machine; the same maths on a weight packed once for oneDNN runs ~2x faster (the vocabulary
head alone: 23 ms -> 5 ms), at fp32 precision. Sibling projections that read the same input
(attention's q/k/v, the MLP's gate/up) are packed as one wider weight: the first sibling called
computes all of them, the others take their slice (measured: `benchmarks/decode_roofline.py`).

Invariant: a pack is used only inside `packed_linears` (the engine's inference scope: no
gradients, one thread on the model) and only while its weights are the ones it was made from
(same storage, same in-place version); a sibling takes a slice only when it is called with the
very tensor (same object, same version) the slice was computed from, and each slice is taken
once. The modules' own forward is back when the scope ends. LoRA factors (peft's `lora_*`
modules) are never packed: they change every training step and are small.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Children of one module that transformers' decoder layers call with the same input tensor.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def packing_available() -> bool:
    """Whether this torch build can pack linear weights for oneDNN (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class LinearPacks:
    """Packed weights of a model's linears (one per linear, or one per sibling group), made at
    first use and remade when a weight changes, with the forwards that use them. Costs one extra
    copy of those weights in memory. Which linears a model has is read once per model: call
    `forget` after changing a model's modules (the engine does when it loads or unloads adapters)."""

    def __init__(self) -> None:
        self._groups: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[torch.nn.Linear, ...]]] = (
            weakref.WeakKeyDictionary()
        )
        # first module of a group -> (weights key, [forward per member])
        self._forwards: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[Any, ...], list[Any]]] = (
            weakref.WeakKeyDictionary()
        )

    def groups(self, model: torch.nn.Module) -> list[tuple[torch.nn.Linear, ...]]:
        groups = self._groups.get(model)
        if groups is None:
            groups = self._groups[model] = _groups(model)
        return groups

    def forget(self) -> None:
        self._groups.clear()

    def forwards(self, group: tuple[torch.nn.Linear, ...]) -> list[Callable[..., Any]]:
        """Each member's packed forward, packing (again) when the weights are not those packed."""
        key: tuple[Any, ...] = tuple((m.weight.data_ptr(), m.weight._version, m.weight.shape) for m in group)
        key += tuple((m.bias.data_ptr(), m.bias._version) for m in group if m.bias is not None)
        held = self._forwards.get(group[0])
        if held is not None and held[0] == key:
            return held[1]
        with torch.no_grad():
            weight = torch.cat([m.weight.detach() for m in group]) if len(group) > 1 else group[0].weight
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            bias = None
            if all(m.bias is not None for m in group):
                bias = torch.cat([m.bias.detach() for m in group if m.bias is not None])
        if len(group) == 1:
            forwards = [_single_forward(group[0], packed, bias)]
        else:
            forwards = _sibling_forwards(group, packed, bias)
        self._forwards[group[0]] = (key, forwards)
        return forwards

    def __len__(self) -> int:
        return len(self._forwards)


def packable(name: str, module: torch.nn.Module) -> bool:
    if type(module) is not torch.nn.Linear:  # subclasses (quantised, peft's own layers) keep theirs
        return False
    weight = module.weight
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and weight.layout == torch.strided
        and not any(part.startswith("lora_") for part in name.split("."))
    )


@contextmanager
def packed_linears(model: torch.nn.Module, packs: LinearPacks) -> Iterator[int]:
    """Within this scope, the model's plain CPU linears compute through packed weights (yields how
    many linears); inputs of another dtype or device, or with gradients on, use the module's own
    forward."""
    patched: list[torch.nn.Linear] = []
    try:
        for group in packs.groups(model):
            for module, forward in zip(group, packs.forwards(group), strict=True):
                # Straight into the instance dict: nn.Module.__setattr__ costs ~10x more, per step.
                module.__dict__["forward"] = forward
                patched.append(module)
        yield len(patched)
    finally:
        for linear in patched:
            linear.__dict__.pop("forward", None)  # the class's forward again


def _groups(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, ...]]:
    """The packable linears, siblings together: a sibling set is fused only when all of it is
    packable with one dtype and one input width, and either all or none of it has a bias."""
    by_parent: dict[str, dict[str, torch.nn.Linear]] = {}
    order: list[torch.nn.Linear] = []
    for name, module in model.named_modules():
        if not packable(name, module):
            continue
        assert isinstance(module, torch.nn.Linear)
        order.append(module)
        # peft wraps a target linear as `<parent>.q_proj.base_layer`: the role is still q_proj.
        path = name.removesuffix(".base_layer")
        parent, _, role = path.rpartition(".")
        by_parent.setdefault(parent, {})[role] = module
    fused: dict[torch.nn.Module, tuple[torch.nn.Linear, ...]] = {}
    for children in by_parent.values():
        for roles in SIBLINGS:
            members = tuple(children[role] for role in roles if role in children)
            if len(members) == len(roles) and _fusable(members):
                for member in members:
                    fused[member] = members
    groups, seen = [], set()
    for module in order:
        group = fused.get(module, (module,))
        if group[0] not in seen:
            seen.add(group[0])
            groups.append(group)
    return groups


def _fusable(members: tuple[torch.nn.Linear, ...]) -> bool:
    first = members[0].weight
    has_bias = {m.bias is not None for m in members}
    return len(has_bias) == 1 and all(
        m.weight.dtype == first.dtype and m.weight.shape[1] == first.shape[1] for m in members
    )


def _usable(x: torch.Tensor, dtype: torch.dtype) -> bool:
    return x.dtype == dtype and x.device.type == "cpu" and not torch.is_grad_enabled()


def _single_forward(module: torch.nn.Linear, packed: Any, bias: torch.Tensor | None) -> Callable[..., Any]:
    plain = type(module).forward.__get__(module)
    dtype = module.weight.dtype

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _usable(x, dtype):
            return plain(x)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def _sibling_forwards(
    group: tuple[torch.nn.Linear, ...], packed: Any, bias: torch.Tensor | None
) -> list[Callable[..., Any]]:
    widths = [m.weight.shape[0] for m in group]
    dtype = group[0].weight.dtype
    # The last fused call: its input (kept alive here, so identity cannot be reused), the input's
    # version, each sibling's slice, and which siblings have not taken theirs yet.
    last: dict[str, Any] = {"input": None}

    def make(position: int, module: torch.nn.Linear) -> Callable[..., Any]:
        plain = type(module).forward.__get__(module)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not _usable(x, dtype):
                return plain(x)
            if last["input"] is x and last["version"] == x._version and position in last["waiting"]:
                last["waiting"].discard(position)
                out = last["slices"][position]
                if not last["waiting"]:
                    last["input"] = last["slices"] = None
                return out
            fused = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            slices = fused.split(widths, dim=-1)
            last.update(
                input=x,
                version=x._version,
                slices=slices,
                waiting=set(range(len(group))) - {position},
            )
            return slices[position]

        return forward

    return [make(position, module) for position, module in enumerate(group)]
