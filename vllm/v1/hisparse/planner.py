# SPDX-License-Identifier: Apache-2.0
"""The capacity planner's former name, kept working: `python -m vllm.v1.hisparse.planner`
runs `python -m vllm.v1.hisparse.capacity plan`, and importing this module gives
`vllm.v1.hisparse.capacity.planner` itself."""

import sys

if __name__ == "__main__":
    from vllm.v1.hisparse.capacity.__main__ import logs_to_stderr

    logs_to_stderr()  # before the planner's imports log anything
    from vllm.v1.hisparse.capacity.planner import main

    sys.exit(main())
else:
    from vllm.v1.hisparse.capacity import planner as _planner

    sys.modules[__name__] = _planner
