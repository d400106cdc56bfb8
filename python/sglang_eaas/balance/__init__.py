"""Expert load balancing: what was routed where (``load``), predicting the next step's load
(``predictor``), how many replicas each expert gets (``scaler``), on which servers
(``placer``), and SGLang's own EPLB on the same statistics for comparison (``eplb``).

Data flows one way: the client and the servers record load with ``balance.load``; the
balancer reads windows and produces placements; nothing here imports the client or server.
"""
