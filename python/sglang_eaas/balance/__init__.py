"""Expert load balancing: what was routed where (``load``), predicting the next step's load
(``predictor``, learned from ``traces``), how many replicas each expert gets (``scaler``), on
which servers (``placer``), SGLang's own EPLB on the same statistics for comparison
(``eplb``), what a placement costs under a load (``evaluate``), and a placement made live on
the expert tier (``apply``).

Data flows one way: the client and the servers record load with ``balance.load``; the
balancer reads windows and produces placements; nothing here imports the client or server.
"""
