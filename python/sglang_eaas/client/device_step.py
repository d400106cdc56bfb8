"""``DeviceStep``: a client's exchange with its expert servers as device work only.

On the ``device`` transport every remote access is a kernel, so the whole exchange of one MoE
layer can be enqueued without the host reading anything back, which is what lets a decode step
be captured in one CUDA graph (the paper's §4.3):

  routing      ``DeviceRoutingTable.assign`` (torch ops) picks a server per (token, k);
  dispatch     per server, ``stamp_request`` bumps the slot's device sequence counter into a
               header template, then one ``put_signal`` writes hidden states, expert ids (-1
               where another server computes), router weights and header, and release-stores
               CLIENT_WRITE_DONE;
  combine      per server, one wait launch acquire-polls SERVER_DONE into a status tensor, one
               read brings the result header and rows, ``check_result`` judges the header into
               the same status tensor, and the rows are added to the output in server order.

Every server gets every token of the batch (dispatch is dense: the host cannot pick rows
without reading the routing back); rows it holds no expert for come back as zeros. The protocol
is the host path's, byte for byte.

Failures never reach the output silently. ``check_result`` writes a ``DeviceCheck`` into the
channel's status tensor, and ``combine`` adds the server's rows only where that status says the
answer came and was checked OK (a ``torch.where`` on the device, no host read): a server that did
not answer, answered corruptly, rejected the request or answered another one adds nothing, and
the status marks the step's output as failed. The first failure is sticky: until the host's next
``check`` it stays in the status, and every later step (a CUDA graph may be replayed several
times before the host looks) adds none of that server's rows either, good answers included, so
no output after a failure looks whole. Requests still go out meanwhile (a launch has no
predicate); their answers are checked and dropped. ``DeviceStep.check`` reads every channel's
status in one host read, clears the failed ones and raises one ``TransportError`` naming each
failed server and why: at once after each step in eager mode, after each replay under a CUDA
graph (``client/graph_check.py``, which redoes the batch eagerly once).
Header templates and answer buffers are made on the first step of each shape, which a graph
runner's warm-up steps (SGLang runs some before capturing) take care of.
"""

from __future__ import annotations

import weakref

import torch

from ibgda import TransportError
from sglang_eaas.client.connection import ServerConnection
from sglang_eaas.protocol.flags import SlotState
from sglang_eaas.protocol.header import HEADER_BYTES, RejectReason
from sglang_eaas.protocol.slot import TORCH_DTYPES, request_header, request_writes
from sglang_eaas.routing_table import DeviceRoutingTable, RoutingTable


def _kernels():
    """``protocol.device_header``, imported on first use: Triton decides at import whether its
    kernels run interpreted, and the CPU twin sets ``TRITON_INTERPRET`` only when it is used."""
    from sglang_eaas.protocol import device_header

    return device_header


class DeviceFailure(TransportError):
    """Exchanges that failed since the last check; ``servers``: address -> what went wrong,
    ``unanswered``: the servers among them that did not answer at all (the others answered
    wrongly: a rejection, a corrupt or foreign answer)."""

    def __init__(self, servers: dict[str, str], unanswered: set[str]):
        super().__init__("; ".join(servers.values()))
        self.servers, self.unanswered = servers, unanswered


def drives_devices(conn: ServerConnection) -> bool:
    """Whether ``conn``'s region is reached by kernels that can wait without the host."""
    return hasattr(conn.region, "launch_wait_flag")


class DeviceChannel:
    """One server's slot driven by kernels: ``dispatch``, then ``combine``."""

    def __init__(self, conn: ServerConnection, table: torch.Tensor, timeout: float):
        slot = conn.slot
        self.address, self.region, self.layout = conn.address, conn.region, slot.layout
        self.base, self.timeout, self.table = slot.base, timeout, table
        self.dtype = TORCH_DTYPES[self.layout.dtype]
        device = table.device
        self.seq = torch.tensor([slot.seq], dtype=torch.int64, device=device)
        # [reached, last flag byte, first DeviceCheck failure, its reject reason]
        self.status = torch.zeros(4, dtype=torch.int32, device=device)
        self._headers: dict[tuple[int, int], torch.Tensor] = {}
        self._answers: dict[int, torch.Tensor] = {}
        self._tokens = 0

    def _header(self, layer_id: int, tokens: int) -> torch.Tensor:
        """The request header template of (layer, tokens); kept, as a graph would refer to it."""
        key = (layer_id, tokens)
        if key not in self._headers:
            packed = request_header(self.layout, layer_id, tokens, seq=0)  # stamped per dispatch
            self._headers[key] = torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(
                self.table.device)
        return self._headers[key]

    def dispatch(self, layer_id: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                 router_weights: torch.Tensor) -> None:
        """Publish one request: two launches (stamp the header, then put it all and signal)."""
        tokens = hidden.shape[0]
        header = self._header(layer_id, tokens)
        _kernels().stamp_request(header, self.seq, self.table)
        # The owner polls on device backends: there is no doorbell to ring.
        self.region.put_signal(request_writes(self.layout, self.base, hidden, expert_ids,
                                              router_weights, header),
                               self.base + self.layout.flag, SlotState.CLIENT_WRITE_DONE)
        self._tokens = tokens

    def combine(self, out: torch.Tensor) -> None:
        """Wait for the answer to the last dispatch, check it and add its rows to ``out``."""
        layout, tokens = self.layout, self._tokens
        self.region.launch_wait_flag(self.base + layout.flag, SlotState.SERVER_DONE,
                                     self.status, self.timeout)
        nbytes = HEADER_BYTES + tokens * layout.hidden_size * self.dtype.itemsize
        if tokens not in self._answers:
            self._answers[tokens] = torch.empty(nbytes, dtype=torch.uint8, device=out.device)
        answer = self._answers[tokens]
        self.region.read(self.base + layout.result_header, answer)  # header, then the rows
        _kernels().check_result(answer, self.seq, tokens, self.table, self.status)
        rows = answer[HEADER_BYTES:].view(self.dtype).view(tokens, layout.hidden_size)
        # A select, not a 0/1 scale: 0 * NaN is NaN, and a failed answer's rows are anything.
        out.add_(torch.where(self.status[2] == 0, rows, 0))

    def failure(self, code: int, reason: int) -> str:
        """The sentence for ``status[2:] == [code, reason]`` (``code`` a failed ``DeviceCheck``)."""
        checks = _kernels().DeviceCheck
        detail = {checks.NO_ANSWER: f"did not answer within {self.timeout:g}s",
                  checks.BAD_HEADER: "answered with a corrupt result header",
                  checks.REJECTED: f"rejected a request: {RejectReason(reason).name}",
                  checks.WRONG_ANSWER: "answered another request"}[checks(code)]
        return f"expert server {self.address} {detail} (device path)"


class DeviceStep:
    """Every server's ``DeviceChannel``, with routing on the device."""

    def __init__(self, connections: list[ServerConnection], table: RoutingTable,
                 timeout: float):
        """One channel per server of ``table``, in its order; the table's holders go into
        device tensors that ``load_table`` updates in place (a captured graph stays valid)."""
        # GPU memory where the device backend runs natively, host memory for its CPU twin.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        crc = _kernels().crc32_table(device)
        by_id = {c.address: c for c in connections}
        for conn in connections:  # a connection keeps its channel: the device seq lives there
            if conn.device_channel is None:
                conn.device_channel = DeviceChannel(conn, crc, timeout)
        self.servers = table.servers
        self.channels = [by_id[server].device_channel for server in table.servers]
        self.routing = DeviceRoutingTable(table, device)
        self.max_tokens = min(ch.layout.max_tokens for ch in self.channels)
        _STEPS.add(self)

    def run(self, layer_id: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
        """Enqueue one layer's exchange; nothing is read back to the host.

        Returns ``[T, H]``: every server's partial sums added in server order, as the host path
        (``EaasClient.forward``) adds them.
        """
        weights = topk_weights.float()
        out = torch.zeros_like(hidden)
        for start in range(0, hidden.shape[0], self.max_tokens):
            chunk = slice(start, start + self.max_tokens)
            # per request, as the host path routes its requests: replicas alternate from each
            # request's first row, so both paths send the same batches (and get the same bits)
            server = self.routing.assign(layer_id, topk_ids[chunk])
            for index, channel in enumerate(self.channels):
                ids = torch.where(server == index, topk_ids[chunk], -1)
                channel.dispatch(layer_id, hidden[chunk], ids, weights[chunk])
            for channel in self.channels:
                channel.combine(out[chunk])
        return out

    def drives(self, view) -> bool:
        """Whether this step's channels are ``view``'s connections' (the same servers in the
        same order, and the same connections: a client that joined its servers again, after
        the monitor lost it, has new ones, and the old ones' regions are unmapped)."""
        return self.servers == view.table.servers and all(
            view.connections[server].device_channel is channel
            for server, channel in zip(self.servers, self.channels))

    def load_table(self, table: RoutingTable) -> None:
        """Route by ``table`` from now on (same servers; between steps)."""
        self.routing.load(table)

    def check(self) -> None:
        """Raise ``DeviceFailure`` naming every server whose exchange failed since the last
        check, and clear those statuses (one host read for all channels)."""
        statuses = torch.stack([channel.status for channel in self.channels]).tolist()
        failures, unanswered = {}, set()
        for channel, (_, _, code, reason) in zip(self.channels, statuses):
            if code != 0:
                channel.status.zero_()
                failures[channel.address] = channel.failure(code, reason)
                if code == _kernels().DeviceCheck.NO_ANSWER:
                    unanswered.add(channel.address)
        if failures:
            raise DeviceFailure(failures, unanswered)

    def forward(self, layer_id: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """``run``, then ``check`` unless a CUDA graph is being captured (the host reads the
        status after the graph's replay then: ``client/graph_check.py``)."""
        out = self.run(layer_id, hidden, topk_ids, topk_weights)
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self.check()
        return out


_STEPS: weakref.WeakSet[DeviceStep] = weakref.WeakSet()  # every live step of this process


def check_every_step() -> None:
    """``DeviceStep.check`` for every step of this process (after a CUDA graph's replay); one
    ``TransportError`` names every failed server of every step."""
    failures = []
    for step in list(_STEPS):
        try:
            step.check()
        except TransportError as exc:
            failures.append(str(exc))
    if failures:
        raise TransportError("; ".join(failures))
