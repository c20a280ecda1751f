# SPDX-License-Identifier: Apache-2.0
"""Capacity of a node for a DSA model: `python -m vllm.v1.hisparse.capacity {plan,simulate}`.

- `planner` (`plan`): what fits, from vLLM's own KV arithmetic, per configuration.
- `simulate`: vLLM's real scheduler run at the planned block counts on the agentic
  workload, with a step-time model of the GPU in place of the worker.
"""
