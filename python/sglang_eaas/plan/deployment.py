"""A deployment the planner considers: how many of each role, and how the expert tier is laid
out. One record, read by the simulator, the search and the writers."""

from __future__ import annotations

from dataclasses import dataclass

EP, TP = "ep", "tp"  # the same names as elastic/switch.py's


@dataclass(frozen=True)
class Deployment:
    attention: int  # attention instances (SGLang instances, the tier's clients)
    expert_servers: int  # active expert servers, one device each
    attention_gpus: int = 1  # devices per attention instance (its --tp)
    hot_replicas: int = 0  # the hottest experts of each layer given one more copy, this many
    layout: str = EP  # EP: experts spread over the servers; TP: every server a part of each
    standby: int = 0  # warm servers holding nothing, taken first when a server is lost
    overlap: bool = False  # two micro-batches, one's communication under the other's compute
    max_running: int = 256  # requests one attention instance decodes at once, at most
    prefill_budget: int = 2048  # prompt tokens one attention instance prefills per step (a
    #   prompt longer than that is prefilled whole, in a step of its own)

    def __post_init__(self) -> None:
        if min(self.attention, self.expert_servers, self.attention_gpus, self.max_running,
               self.prefill_budget) < 1 or min(self.hot_replicas, self.standby) < 0 \
                or self.layout not in (EP, TP):
            raise ValueError(f"deployment out of range: {self}")

    @property
    def gpus(self) -> int:
        """Devices paid for: attention, active and standby expert servers."""
        return self.attention * self.attention_gpus + self.expert_servers + self.standby

    def label(self) -> str:
        return (f"{self.attention}x{self.attention_gpus} attn + {self.expert_servers} "
                f"{self.layout.upper()}" + (f" +{self.hot_replicas} hot" if self.hot_replicas
                                            else "")
                + (f" +{self.standby} standby" if self.standby else "")
                + (" TBO" if self.overlap else ""))
