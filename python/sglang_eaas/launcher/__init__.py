"""What runs in SGLang's launcher process, before any worker exists: starting local expert
servers (``local_servers.py``), probing remote ones and checking their model, weights and the
placement (``prepare.py``, the body of the ``Engine._launch_subprocesses`` hook), and the
offline engine, ``sglang_eaas.Engine`` (``engine.py``: SGLang's ``Engine`` with the ``--eaas``
options as keywords, whose process is the launcher's).

Data flows one way: this package uses only modules outside ``client/`` (``config``,
``placement``, ``checkpoint``, ``protocol``, ``tools.server_process``...), and ``client/`` (what
runs in SGLang's workers) never imports it.
"""
