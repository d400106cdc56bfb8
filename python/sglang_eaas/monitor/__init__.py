"""The monitor: who is in the expert tier (servers and clients), by heartbeats.

``server.py`` is the embedded (started by the SGLang launcher) or standalone
(``python -m sglang_eaas.monitor``) monitor, ``registry.py`` its state. What members and
watchers use to reach a monitor (of either kind, or etcd) is ``sglang_eaas.membership``.
"""
