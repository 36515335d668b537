"""The OpenAI API features against the real distributed server and the real `openai` client:
`n`, logprobs, sampling controls and penalties, prompt lists, echo, stop_token_ids, tokenize;
tokens and logprobs equal to the single-process engine, and the same across a `kill -9`.

`n` > 1 makes one engine request per choice with seed `seed + j` (vLLM's derivation), so
choice j equals `elastic-ep generate --seed seed+j`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from .conftest import PROMPTS

MODEL = "tiny-deepseek-v3"
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "presence_penalty": 0.4,
            "frequency_penalty": 0.3, "repetition_penalty": 1.1}
FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
         "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
         "repetition_penalty": "--repetition-penalty"}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--model", MODEL, "--ep-size", "4", "--enable-chaos", "--restart-delay-s", "1.0")


def offline(prompt: str, max_tokens: int, seed: int, logprobs: int) -> dict:
    """`elastic-ep generate --json` of one prompt with SAMPLING."""
    cmd = [sys.executable, "-m", "elastic_ep.cli", "generate", "--json", "--model", MODEL, "--prompt", prompt,
           "--max-tokens", str(max_tokens), "--seed", str(seed), "--logprobs", str(logprobs), "--ignore-eos"]
    for name, flag in FLAGS.items():
        cmd += [flag, str(SAMPLING[name])]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout)


def choice_tokens(choice) -> tuple[list[str], list[float]]:
    return choice.logprobs.tokens, choice.logprobs.token_logprobs


def test_n_seeded_sampling_penalties_and_logprobs_equal_the_offline_engine(server):
    out = server.client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=12, n=2, seed=7,
                                           logprobs=2, extra_body={"ignore_eos": True, **SAMPLING})
    assert [c.index for c in out.choices] == [0, 1]
    for j, choice in enumerate(out.choices):
        ref = offline(PROMPTS[0], 12, 7 + j, 2)
        assert choice.text == ref["text"]
        served = choice.logprobs.token_logprobs
        assert served == pytest.approx([t["logprob"] for t in ref["logprobs"]], abs=1e-5)
        assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)  # the top 2, and the sampled one
    assert out.choices[0].text != out.choices[1].text  # each choice has its own seed


def test_prompt_lists_echo_stop_token_ids_and_tokenize(server):
    ids = server.http.post("/tokenize", json={"model": server.model, "prompt": PROMPTS[1]}).json()["tokens"]
    assert server.http.post("/detokenize", json={"model": server.model, "tokens": ids}).json()["prompt"] == PROMPTS[1]
    as_text = server.client.completions.create(model=server.model, prompt=[PROMPTS[1], PROMPTS[0]], max_tokens=6,
                                               temperature=0, echo=True)
    as_ids = server.client.completions.create(model=server.model, prompt=[ids], max_tokens=6, temperature=0,
                                              echo=True)
    assert len(as_text.choices) == 2 and as_text.choices[0].text == as_ids.choices[0].text
    assert as_text.choices[0].text.startswith(PROMPTS[1]) and as_text.choices[1].text.startswith(PROMPTS[0])
    greedy = server.client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    first = server.http.post("/tokenize", json={"model": server.model, "prompt": greedy.choices[0].text}).json()
    stopped = server.client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                               extra_body={"stop_token_ids": [first["tokens"][0]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""


def test_tokens_and_logprobs_are_the_same_across_a_kill(server):
    """n=2 seeded streams with logprobs, once without a fault and once with a rank killed mid-stream."""
    server.wait_full_group(4)

    def run(inject=None) -> list[tuple[str, list[float]]]:
        started = threading.Event()
        chunks: dict[int, list] = {0: [], 1: []}
        stream = server.client.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=32, n=2,
                                                  seed=11, logprobs=1, stream=True,
                                                  extra_body={"ignore_eos": True, **SAMPLING})
        for chunk in stream:
            for choice in chunk.choices:
                chunks[choice.index].append(choice)
            if inject is not None and not started.is_set() and all(len(c) >= 4 for c in chunks.values()):
                started.set()
                inject()
        return [("".join(c.text for c in cs), [lp for c in cs for lp in c.logprobs.token_logprobs])
                for cs in chunks.values()]

    before = run()
    pid = server.pids()[1]
    after = run(lambda: os.kill(pid, signal.SIGKILL))
    assert server.cluster()["epoch"] > 0  # the kill landed: a new epoch formed
    for (text_a, lp_a), (text_b, lp_b) in zip(before, after, strict=True):
        assert text_a == text_b
        assert lp_a == pytest.approx(lp_b, abs=1e-5)
