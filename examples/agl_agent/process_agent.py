"""The same agent as a process agent (Agent Lightning 1.0's protocol), with no Agent Lightning
or agl-stream code: agl-stream's runner starts it once per attempt,

    agl-stream worker runner --agent-command "python examples/agl_agent/process_agent.py"

with the task in AGL_TASK_INPUT, the attempt's resources in AGL_RESOURCES, its LLM URL in
AGL_OPENAI_BASE_URL and where to report in AGL_EVENT_URL (AGL_KEY opens both)."""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

RULES = {"cite": "Cite a source.", "brief": "Be brief.", "polite": "Be polite."}


def post(url: str, body: Any) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {os.environ['AGL_KEY']}",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def main() -> None:
    task = json.loads(os.environ["AGL_TASK_INPUT"])
    template = json.loads(os.environ["AGL_RESOURCES"])["prompt_template"]["template"]
    reply = post(
        f"{os.environ['AGL_OPENAI_BASE_URL']}/chat/completions",
        {
            "model": os.environ["AGL_MODEL"],
            "messages": [{"role": "user", "content": template.format(question=task["question"])}],
        },
    )
    answer = reply["choices"][0]["message"]["content"] or ""
    reward = sum(f"[{w}]" in answer for w in task["wants"]) / len(task["wants"])
    post(
        os.environ["AGL_EVENT_URL"],
        [
            {
                "type": "message",
                "message": json.dumps({"question": task["question"], "answer": answer}),
            },
            {"type": "reward", "value": reward},
        ],
    )
    print(f"{task['question']} -> {answer!r} (reward {reward:g})")


if __name__ == "__main__":
    main()
