"""One attention client's connection to one expert server: its joined slots (one per micro-batch
in flight) and its control channel."""

from __future__ import annotations

from ibgda import RegionHandle, TransportError, create_transport
from sglang_eaas import envs, transports
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.protocol.control import JoinRequest, Ready, ReleaseSlots, ServerStats, Stats
from sglang_eaas.protocol.lines import Channel
from sglang_eaas.protocol.slot import ClientSlot, dtype_name

LEAVE_TIMEOUT = 2.0  # seconds a closing client waits for the server to take its slot back


class ServerConnection:
    """Joins on construction; the slot stays ours while the control channel is open."""

    def __init__(self, address: str, client_name: str, model: ModelIdentity, dtype: str,
                 token: str | None = None, transport: str = transports.AUTO,
                 timeout: float = 30.0, incarnation: str = "", client_incarnation: str = "",
                 slots: int = 1):
        """Join in two steps per slot: ``join`` reserves a slot, ``ready`` (sent once the
        region is mapped here) makes the server poll it; a failure in between frees the slot.
        ``slots``: how many (1, or 2 for two micro-batches in flight: ``slots[i]`` is micro-batch
        ``i``'s).

        ``incarnation``: the server's, as the monitor knows it ("" for a server the monitor
        does not know); ``client_incarnation``: this client's, so the server takes the slot
        back when the monitor loses this client."""
        self.address, self.incarnation = address, incarnation
        self.client_incarnation = client_incarnation  # the one this slot belongs to
        self.lost_why: str | None = None  # set when this server is known lost: stop waiting
        # the monitor suspects it (late heartbeats): the tier routes its experts to their
        # other holders while it is, where there are some
        self.suspected = False
        self.suspected_at = 0.0  # when this client learned it (monotonic)
        # the monitor lost it on heartbeats alone while it was the last holder of some expert:
        # kept in use (it answers exchanges) until it registers again or the data path fails it
        self.kept_why: str | None = None
        # Requests sent and not collected yet (two micro-batches may have one each): the tier
        # unmaps a dropped connection's region only at 0, never under a wait still to come.
        self.in_flight = 0
        self.slots: list[ClientSlot] = []
        self.region = None
        self.device_channel = None  # client.device_step.DeviceChannel, made on first use
        self._channel = Channel(address, envs.TOKEN.get() if token is None else token,
                                       timeout)
        join = JoinRequest(client_name, model.fingerprint, dtype_name(dtype), transport,
                           list(model.expert_digests), client_incarnation)
        try:
            for _ in range(slots):
                reply = self._channel.call(join)
                self.layout = reply.layout
                # what the server holds (the tier keeps it current: the monitor says changes)
                self.holdings: ServerHoldings = reply.holdings
                self.moe_layers: list[int] = reply.moe_layers
                if self.region is None:  # every slot of a server is in its one region
                    handle = RegionHandle.from_dict(reply.region)
                    self.region = create_transport(handle.backend).connect(handle)
                self.slots.append(ClientSlot(self.region, reply.base, self.layout, reply.bell,
                                             reply.first_seq))
                self._channel.call(Ready())
        except BaseException:
            self.close()
            raise

    @property
    def slot(self) -> ClientSlot | None:
        """Micro-batch 0's slot (the only one without two-batch overlap)."""
        return self.slots[0] if self.slots else None

    def closed_by_server(self) -> bool:
        """Whether the server closed the control connection (it died, or took the slot back):
        a peek that does not block and does not consume a reply."""
        return self._channel.closed_by_peer()

    def socket(self):
        return self._channel.socket

    def stats(self) -> ServerStats:
        return self._channel.call(Stats())

    def close(self) -> None:
        """Leave the slot (OFFLINE), wait for the server to take it back, close the control
        channel. A server that is already gone needs no goodbye."""
        if self.slots:
            # The slots are ours to mark OFFLINE only while the server has not taken them back
            # (it closes the connection when it does, and may hand them to another client).
            if not self.closed_by_server():
                for slot in self.slots:
                    slot.leave()
            self.slots = []
            try:
                self._channel.settimeout(LEAVE_TIMEOUT)  # a hung server must not hang our exit
                self._channel.call(ReleaseSlots())
            except (TransportError, ValueError):
                pass
        if self.region is not None:
            self.region.close()
            self.region = None
        self._channel.close()
