"""Slices of experts along the intermediate dimension: tensor parallelism over expert servers
(issue 22, docs/switching.md).

Part ``p`` of ``P`` of an expert is rows ``p * I/P .. (p+1) * I/P - 1`` of its gate projection
and the same rows of its up projection, kept paired as ``w13`` keeps a whole expert (gate rows,
then up rows), and the same columns of its down projection. The kernels that compute a whole
expert compute a part unchanged: ``silu(gate_p x) * (up_p x)`` is part ``p`` of the expert's
intermediate activation, ``down_p`` maps it to that part's share of the output, and the ``P``
shares add up to the expert's output, exact up to the order of the float additions. A layer of
parts is a ``LayerExperts`` whose rows are ``I/P`` wide; its rows live in a ``WeightStore`` of
``Part.info`` (the model's shape with ``I/P``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sglang_eaas.model_info import MoeModelInfo


@dataclass(frozen=True)
class Part:
    """Part ``index`` of ``parts`` of every expert of a layer (``Part(0, 1)``: whole experts)."""

    index: int
    parts: int

    def check(self, intermediate: int) -> None:
        """``ValueError`` (one sentence) unless ``parts`` divides ``intermediate`` and
        ``0 <= index < parts``."""
        if self.parts < 1 or not 0 <= self.index < self.parts:
            raise ValueError(f"part {self.index} of {self.parts} does not exist: parts are "
                             f"numbered 0 to parts - 1, and there is at least one")
        if intermediate % self.parts:
            raise ValueError(f"an expert's intermediate size {intermediate} does not split "
                             f"into {self.parts} equal parts")

    def bounds(self, intermediate: int) -> tuple[int, int]:
        """The part's rows of gate (and of up), and columns of down: ``[lo, hi)``."""
        self.check(intermediate)
        width = intermediate // self.parts
        return self.index * width, (self.index + 1) * width

    def info(self, info: MoeModelInfo) -> MoeModelInfo:
        """The model's expert shape as a layer of this part's rows sees it (``I / parts``)."""
        self.check(info.moe_intermediate_size)
        return replace(info, moe_intermediate_size=info.moe_intermediate_size // self.parts)

    def of(self, tensor: torch.Tensor, projection: int) -> torch.Tensor:
        """This part of one checkpoint tensor (a view): ``projection`` 0 (gate) or 1 (up)
        ``[I, H]`` -> rows; 2 (down) ``[H, I]`` -> columns."""
        if projection < 2:
            lo, hi = self.bounds(tensor.shape[0])
            return tensor[lo:hi]
        lo, hi = self.bounds(tensor.shape[1])
        return tensor[:, lo:hi]


def part_rows(w13: torch.Tensor, w2: torch.Tensor, part: Part
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``part`` of whole experts' rows (``w13 [n, 2I, H]``, ``w2 [n, H, I]``), as new contiguous
    tensors ``[n, 2I/P, H]`` and ``[n, H, I/P]``: gate rows then up rows, down columns."""
    width = w2.shape[-1] // part.parts
    out13 = w13.new_empty(w13.shape[0], 2 * width, w13.shape[2])
    out2 = w2.new_empty(w2.shape[0], w2.shape[1], width)
    cut_into(w13, w2, part, out13, out2)
    return out13, out2


def cut_into(w13: torch.Tensor, w2: torch.Tensor, part: Part, out13: torch.Tensor,
             out2: torch.Tensor) -> None:
    """``part`` of whole experts' rows copied into ``out13 [n, 2I/P, H]`` and ``out2 [n, H,
    I/P]`` (any dtype: converted), one copy of only the part's bytes."""
    inter = w2.shape[-1]
    lo, hi = part.bounds(inter)
    width = hi - lo
    out13[:, :width].copy_(w13[:, lo:hi])
    out13[:, width:].copy_(w13[:, inter + lo:inter + hi])
    out2.copy_(w2[:, :, lo:hi])


def assemble_into(part13: torch.Tensor, part2: torch.Tensor, part: Part, out13: torch.Tensor,
                  out2: torch.Tensor) -> None:
    """``part``'s rows (``part13 [n, 2I/P, H]``, ``part2 [n, H, I/P]``) copied into their place
    in whole experts' rows ``out13 [n, 2I, H]``, ``out2 [n, H, I]``: ``cut_into`` undone, so the
    P parts of an expert assembled give its rows back bit for bit."""
    inter = out2.shape[-1]
    lo, hi = part.bounds(inter)
    width = hi - lo
    out13[:, lo:hi].copy_(part13[:, :width])
    out13[:, inter + lo:inter + hi].copy_(part13[:, width:])
    out2[:, :, lo:hi].copy_(part2)
