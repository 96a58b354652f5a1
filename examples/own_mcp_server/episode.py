"""Scripted episodes against `rlgate up --mcp time=...` with this folder's tasks.json: what a trainer's agent
loop does, without a model. For each task: Reset, list the tools through the toolgateway (with the agent
token Reset returned), call `convert_time`, answer; the reward comes from the task's scoring.

    python examples/own_mcp_server/episode.py --orchestrator 127.0.0.1:50051
"""

from __future__ import annotations

import argparse

import rlgate
from rlgate.core.convert import parse_json_object

# Each task's question, as the arguments of the conversion that answers it.
CONVERSIONS = {
    "time-tokyo-noon": {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
    "time-kathmandu-checked": {"source_timezone": "UTC", "time": "09:30", "target_timezone": "Asia/Kathmandu"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orchestrator", default="127.0.0.1:50051", help="orchestrator address")
    args = parser.parse_args()
    with rlgate.Client(args.orchestrator) as client:
        with client.episode(env_key="time") as ep:  # an episode by env key: no task, no scoring
            print(f"env time: tools {[t.name for t in ep.tools]}")
        for task_key, arguments in CONVERSIONS.items():
            with client.episode(task_key=task_key) as ep:
                tools = [t.name for t in ep.list_tools()]
                result = ep.call_tool("convert_time", arguments).result
                converted = parse_json_object(result.structured_content_json, "convert_time result")
                answer = str(converted["target"]["datetime"])[11:16]  # ISO 8601: HH:MM after the date
                step = ep.step(final_answer=answer)
                print(f"{task_key}: tools {tools}, answer {answer}, reward {step.reward} ({step.verification.status})")


if __name__ == "__main__":
    main()
