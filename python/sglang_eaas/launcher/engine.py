"""``sglang_eaas.Engine``: SGLang's offline engine with the ``--eaas`` options as keywords.

``sglang.Engine(**kwargs)`` builds ``ServerArgs(**kwargs)`` with no command line, so the options
the plugin adds to SGLang's parser never reach it. This engine builds the record the way
``python -m sglang.launch_server`` does, from one parser and one set of checks:

1. SGLang's own parser (``ServerArgs.add_cli_args``, to which the plugin adds its group) reads
   the ``eaas*`` keywords as the flags they are named after: ``eaas_monitor="h:p"`` is
   ``--eaas-monitor h:p``, ``eaas=True`` is ``--eaas``;
2. SGLang's keywords go onto the parsed options as the typed values ``sglang.Engine`` would pass
   to ``ServerArgs`` (SGLang's parser defaults for the rest, as on the command line);
3. ``ServerArgs.from_cli_args`` builds the record, with the plugin's hooks on it: the
   ``EaasConfig`` checked and attached (``ServerArgs._eaas``), ESFT adapters made SGLang's LoRA
   adapters, two-batch overlap resolved;
4. ``sglang.Engine(server_args=...)`` launches, through the same launcher hook as the server
   (``prepare.launch_subprocesses``: the monitor and local expert servers start there).

A bad keyword or value is the command line's one sentence with the keyword's name for the
flag's, as a ``ValueError``, before anything starts; a launch that cannot serve (an expert
server that does not start, a monitor that does not answer) a ``RuntimeError``. ``shutdown()``
stops the local expert servers and the embedded monitor the launch started, then SGLang's
processes.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from sglang.srt.entrypoints.engine import Engine as SGLangEngine
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs

from sglang_eaas.refusal import Refusal
from sglang_eaas.launcher import prepare

_FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*")
# --eaas-autoscale posts its decisions to the HTTP server's admin API (launcher/admin.py)
NEEDS_HTTP = {"eaas_autoscale": "the autoscaler's decisions go to the HTTP server's admin API "
                                "(/eaas/autoscale), which the offline engine does not run"}


class _Complaint(Exception):
    """What SGLang's parser says is wrong with the options."""


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises its complaint instead of printing usage and exiting."""

    def error(self, message: str):
        raise _Complaint(message)


class Options:
    """SGLang's server options with the plugin's group: which keywords exist, the flag each
    ``eaas*`` keyword stands for, and the keyword each flag in a sentence stands for."""

    def __init__(self):
        from sglang.srt.arg_groups.arg_utils import record_fields

        load_plugins()  # idempotent: the plugin's hooks applied in this process
        self.parser = _Parser(prog="sglang_eaas.Engine", add_help=False)
        ServerArgs.add_cli_args(self.parser)
        self.actions = {a.dest: a for a in self.parser._actions if a.option_strings}
        self.by_flag = {flag: a for a in self.actions.values() for flag in a.option_strings}
        self.fields = {f.name for f in record_fields(ServerArgs)}
        self.eaas = sorted(d for d in self.actions if d == "eaas" or d.startswith("eaas_"))
        if "eaas" not in self.eaas:
            raise RuntimeError("the sglang-eaas plugin is not loaded in this process: SGLang's "
                               "options have no --eaas (check that sglang-eaas is installed in "
                               "this environment and that SGLANG_PLUGINS, if set, includes "
                               "'eaas')")

    def keywords(self, sentence: str) -> str:
        """``sentence`` with each of SGLang's flags named as the keyword it is here."""
        def keyword(match: re.Match) -> str:
            action = self.by_flag.get(match.group(0))
            if action is None:
                return match.group(0)
            if action.nargs == 0:
                return f"{action.dest}={not match.group(0).startswith('--no-')}"
            return action.dest

        return _FLAG.sub(keyword, sentence.removeprefix("argument "))

    def argv(self, eaas: dict[str, Any]) -> list[str]:
        """The command-line flags the ``eaas*`` keywords stand for."""
        argv = []
        for key, value in eaas.items():
            if key not in self.eaas:
                raise ValueError(f"unknown keyword {key}: the sglang-eaas options are "
                                 f"{', '.join(self.eaas)}")
            action = self.actions[key]
            flag = max(action.option_strings, key=len)
            if action.nargs == 0:
                if not isinstance(value, bool):
                    raise ValueError(f"{key} takes True or False, got {value!r}")
                argv += [flag] if value else []
            elif value is not None:
                if isinstance(value, bool) or not isinstance(value, (str, int, float,
                                                                     os.PathLike)):
                    raise ValueError(f"{key} takes what {flag} takes on the command line (a "
                                     f"string or number), got {value!r}")
                text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
                argv.append(f"{flag}={text}")
        return argv


def build_server_args(kwargs: dict[str, Any], options: Options) -> ServerArgs:
    """``ServerArgs`` for ``sglang_eaas.Engine(**kwargs)``, the command line's way (module
    docstring); ``ValueError`` (one sentence naming the keyword) for what it refuses."""
    if "server_args" in kwargs:
        raise ValueError("sglang_eaas.Engine builds its ServerArgs itself: pass SGLang's options "
                         "as keywords, not server_args")
    eaas = {k: v for k, v in kwargs.items() if k == "eaas" or k.startswith("eaas_")}
    sglang = {k: v for k, v in kwargs.items() if k not in eaas}
    unknown = sorted(set(sglang) - options.fields)
    if unknown:
        raise ValueError(f"unknown keyword {unknown[0]}: neither one of SGLang's ServerArgs "
                         "fields nor an sglang-eaas option")
    for key, why in NEEDS_HTTP.items():
        if eaas.get(key):
            raise ValueError(f"{key} needs SGLang's HTTP server (python -m "
                             f"sglang.launch_server): {why}")
    sglang.setdefault("log_level", "error")  # sglang.Engine's default: no logs
    argv = options.argv(eaas)
    if "model_path" in sglang:
        argv = ["--model-path", os.fspath(sglang["model_path"]), *argv]
    try:
        args = options.parser.parse_args(argv)
        for key, value in sglang.items():
            setattr(args, key, value)
        server_args = ServerArgs.from_cli_args(args)
    except _Complaint as exc:
        raise ValueError(options.keywords(str(exc))) from None
    except Refusal as exc:
        raise ValueError(options.keywords(exc.sentence)) from None
    from sglang.srt.sampling.watermarking.core import redact_watermark_secrets

    server_args._launch_command = "sglang_eaas.Engine(" + ", ".join(
        f"{k}={v!r}" for k, v in redact_watermark_secrets({**sglang, **eaas}).items()) + ")"
    return server_args


class Engine(SGLangEngine):
    """``sglang.Engine`` taking the ``--eaas`` options as keywords named after the flags
    (``eaas=True, eaas_expert_servers="local:2"``) beside SGLang's own; ``generate`` and the
    rest are SGLang's. ``shutdown()`` (also at exit) stops what the launch started for the
    expert tier before SGLang's processes."""

    def __init__(self, **kwargs: Any):
        options = Options()
        server_args = build_server_args(kwargs, options)
        try:
            super().__init__(server_args=server_args)
        except Refusal as exc:
            prepare.stop_started()
            raise RuntimeError(options.keywords(exc.sentence)) from None
        except BaseException:
            prepare.stop_started()
            raise

    def shutdown(self) -> None:
        try:
            prepare.stop_started()  # SIGTERM: SGLang's shutdown SIGKILLs every child left
        finally:
            super().shutdown()
