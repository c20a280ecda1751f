# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm.v1.hisparse.capacity plan|simulate ...`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: python -m vllm.v1.hisparse.capacity {plan,simulate} [options]

  plan      what one node holds per configuration (sessions, contexts, host pool)
  simulate  vLLM's real scheduler on the agentic workload at production scale,
            with a step-time model of the GPUs (no model, no device)

`python -m vllm.v1.hisparse.capacity COMMAND --help` describes each command's options.
"""


def logs_to_stderr() -> None:
    """vLLM logs to stdout unless VLLM_LOGGING_STREAM says otherwise; here stdout is the
    report (with `--format json`, one JSON document), so vLLM's log lines go to stderr."""
    import logging

    import vllm.logger  # noqa: F401  (configures vLLM's loggers)

    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    logs_to_stderr()
    if command == "plan":
        from vllm.v1.hisparse.capacity.planner import main as plan_main

        return plan_main(rest)
    if command == "simulate":
        from vllm.v1.hisparse.capacity.simulate import main as simulate_main

        return simulate_main(rest)
    sys.stderr.write(f"error: unknown command {command!r}\n{USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
