"""The tier controller (docs/elastic.md, "The tier controller"): every change of what the expert
tier holds is one operation, serialised by one lease in the monitor and recorded there.

* ``lease.py``: the ``Fence`` a driver's changes carry and the thread keeping the lease alive;
* ``controller.py``: ``TierController``, acquire / recover / run / record;
* ``end_state.py``: the tier's end state as operations read it back and record it;
* ``recovery.py``: finishing or rolling back an operation whose driver died;
* ``bounds.py``: what is refused before anything starts.

The records and the monitor's side of the lease are ``protocol/operations.py``,
``monitor/operations.py`` and ``membership/etcd.py``.
"""
