"""A stand-alone agent process for the agent-kill test and ``benchmarks.chaos``:
``python agent_process.py BASE_URL KEY TURNS PAUSE_S`` plays ``TURNS`` chat turns through the proxy
with the official SDK (printing ``turn N`` after each, then sleeping ``PAUSE_S``), then sets a reward
of 1 and exits."""

from __future__ import annotations

import argparse
import time

import httpx
import openai


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base_url")
    ap.add_argument("key")
    ap.add_argument("turns", type=int)
    ap.add_argument("pause", type=float)
    a = ap.parse_args(argv)
    base_url, key, turns, pause = a.base_url, a.key, a.turns, a.pause
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "Map:\nP _\n_ G\nWhat is your move?"}]
    for t in range(turns):
        answer = client.chat.completions.create(model="m", messages=messages, max_tokens=8).choices[0].message
        print(f"turn {t}", flush=True)
        messages += [{"role": "assistant", "content": answer.content}, {"role": "user", "content": f"Turn {t}."}]
        time.sleep(pause)
    httpx.post(base_url + "/rl/set_reward", headers={"Authorization": f"Bearer {key}"}, json={"reward": 1.0},
               timeout=30).raise_for_status()


if __name__ == "__main__":
    main()
