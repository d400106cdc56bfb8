"""ibgda: one-sided peer-to-peer regions over shared memory, Mooncake and device kernels.

See ``ibgda.region`` for the API and ``ibgda/README.md`` for the backends.
"""

from ibgda.backends import BACKENDS, create_transport
from ibgda.region import LocalRegion, RegionHandle, RemoteRegion, Transport, TransportError

__all__ = ["BACKENDS", "LocalRegion", "RegionHandle", "RemoteRegion", "Transport",
           "TransportError", "create_transport"]
