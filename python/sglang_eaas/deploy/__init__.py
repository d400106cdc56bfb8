"""A whole local deployment from one config file: ``python -m sglang_eaas.deploy CONFIG.yaml``.

``config.py`` reads and checks the file (``load_config``, ``DeployConfig``), ``parts.py`` makes
each part's command line, ``processes.py`` runs them (own process groups, log files, stopped
until nothing is left), ``ready.py`` says when each part serves, and ``deployment.py`` starts
them in order and stops them in reverse (``Deployment``, a context manager).
"""

from sglang_eaas.deploy.config import DeployConfig, DeployConfigError, load_config, parse_config
from sglang_eaas.deploy.deployment import DeployError, Deployment, Endpoint, Interrupted

__all__ = ["DeployConfig", "DeployConfigError", "DeployError", "Deployment", "Endpoint",
           "Interrupted", "load_config", "parse_config"]
