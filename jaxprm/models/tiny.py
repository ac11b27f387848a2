"""The "tiny" preset: a small random-init Llama-family model and a task-sized tokenizer.

The tokenizer is a byte-level BPE trained (deterministically, by the ``tokenizers`` library) on
generated FrozenLake-style text: grid rows of ``P _ O G`` cells, digits, the actions
``Up / Down / Left / Right`` in triple-backtick fences, the usual instructions and feedback, and
ChatML turns (the chat template is ``rollout.chat.TOOLS_TEMPLATE``: ChatML, with Qwen2.5's
Hermes-style function tools when a request has them). Byte-level BPE starts from all 256 bytes, so it encodes any text (unknown characters
fall back to their UTF-8 bytes) and decodes it back exactly. Special tokens: ``<|endoftext|>``
(id 0, padding), ``<|im_start|>`` (1), ``<|im_end|>`` (2, end of turn = EOS).
"""

from __future__ import annotations

import random

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxprm.models.config import ModelConfig
from jaxprm.models.tokenizer import Tokenizer
from rollout.chat import TOOLS_TEMPLATE

__all__ = ["TINY_VOCAB_SIZE", "tiny_config", "build_tiny_tokenizer", "tiny_corpus"]

TINY_VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


_ACTIONS = ("Left", "Down", "Right", "Up")
_INSTRUCTIONS = (
    "You are walking on a frozen lake.",
    "FrozenLake Quick Guide",
    "Goal: Reach the goal (G).",
    "Symbols (If the player is on the goal or hole, it will be shown as the player symbol):",
    "_ Frozen | O Hole | G Goal | P Player",
    "Rules:",
    "1. Avoid falling into holes (O).",
    "2. Frozen tiles are slippery, you may move perpendicular to your intended direction.",
    "Valid Action (separated by | ):",
    "Up | Down | Left | Right",
    "Rewards:",
    "Fall into hole: 0",
    "Reach goal: +1.0",
    "You will be provided the current observation, please decide on the next Action.",
    "You should show your thought process and then input the final action in ``` ```.",
    "You should only output the NEXT ACTION at each interaction in the ``` ```.",
    "For example, if you want to move up, you should output ```Up```.",
    "You should plan ahead and need to achieve it in minimum number of steps.",
    "Please show your thinking process and put the final action in ``` ```.",
    "In every turn, the final action MUST be one of Up, Down, Left, Right.",
    "You are a helpful assistant.",
    "You are playing FrozenLake on a grid. Symbols: P is you, _ is frozen ice (safe), O is a hole "
    "(falling in ends the game), G is the goal. Reach G without stepping into an O.",
    "Each turn, answer with exactly one move written in a fenced block: ```Left```, ```Down```, "
    "```Right``` or ```Up```. Left/Right change the column, Up/Down change the row (row 0 is the top).",
    "Moving into the edge of the grid leaves you where you are.",
)
_FEEDBACK = (
    "You moved {a}.",
    "You moved {a}.",
    "You moved {a} into the edge and stayed in place.",
    "You moved {a} and reached the goal.",
    "You moved {a} and fell into a hole.",
    "You moved {a}. Out of turns.",
    "Invalid answer. Reply with exactly one move in a fenced block: "
    "```Left```, ```Down```, ```Right``` or ```Up```.",
    "You have not achieved the goal, P has not reached G yet. Please give the next action.",
    "Your last action was invalid. Please answer with one of Up, Down, Left, Right.",
    "You reached the goal!",
    "You fell into a hole.",
    "The action had no effect: you hit the wall.",
    "Invalid action.",
)
_THOUGHTS = (
    "The goal is to the {d1} and below, so I should move {a}.",
    "There is a hole to the {d1}, so I will go {a} instead.",
    "I am at row {r}, column {c}. The goal G is at row {gr}, column {gc}.",
    "Moving {a} brings me closer to the goal.",
    "I should avoid the hole at row {r}, column {c}.",
    "Let me think step by step. The player P needs to reach G.",
)


def _grid(rng: random.Random, n: int, sep: str) -> str:
    cells = [["_"] * n for _ in range(n)]
    for _ in range(rng.randint(1, max(1, n * n // 4))):
        cells[rng.randrange(n)][rng.randrange(n)] = "O"
    gr, gc = rng.randrange(n), rng.randrange(n)
    cells[gr][gc] = "G"
    pr, pc = rng.randrange(n), rng.randrange(n)
    cells[pr][pc] = "P"
    return "\n".join(sep.join(row) for row in cells)


def _turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def tiny_corpus(num_episodes: int = 300, seed: int = 0) -> list[str]:
    """Deterministic FrozenLake-style chat transcripts (one string per episode)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_episodes):
        n = rng.choice((2, 3, 4, 4, 4, 5, 6, 6, 8))
        sep = rng.choice((" ", " ", " ", "\t", ""))
        system = "\n".join(rng.sample(_INSTRUCTIONS, k=rng.randint(4, len(_INSTRUCTIONS))))
        parts = [_turn("system", system)]
        for step in range(rng.randint(1, 6)):
            if rng.random() < 0.5:
                obs = f"Map:\n{_grid(rng, n, ' ')}\n"
                obs += f"You are at row {rng.randrange(n)}, column {rng.randrange(n)}. What is your move?"
            else:
                obs = f"Current Observation ({step}):\n{_grid(rng, n, sep)}\n"
                obs += f"The maximum number of steps remaining is {rng.randint(1, 20)}."
            if step:
                obs = rng.choice(_FEEDBACK).format(a=rng.choice(_ACTIONS)) + "\n" + obs
            parts.append(_turn("user", obs))
            a = rng.choice(_ACTIONS)
            thought = rng.choice(_THOUGHTS).format(
                d1=rng.choice(("left", "right", "up", "down")), a=a.lower(), r=rng.randrange(n),
                c=rng.randrange(n), gr=rng.randrange(n), gc=rng.randrange(n),
            )
            answer = rng.choice((f"```{a}```", f"{thought} ```{a}```", f"{thought}\n```{a}```"))
            parts.append(_turn("assistant", answer))
        docs.append("".join(parts))
    return docs


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Tokenizer:
    """Train the tiny byte-level BPE (deterministic for a given ``tokenizers`` version)."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # The special tokens are registered by the trainer; strip them from the training text.
    docs = tiny_corpus()
    for tok in SPECIAL_TOKENS:
        docs = [d.replace(tok, "\n") for d in docs]
    backend.train_from_iterator(docs, trainer=trainer)
    return Tokenizer(
        backend,
        chat_template=TOOLS_TEMPLATE,  # ChatML; Hermes-style tools when a request has them
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=2048,
    )


def tiny_config(vocab_size: int = TINY_VOCAB_SIZE, param_dtype: str | None = "float32") -> ModelConfig:
    """The tiny model: Llama family, 2 layers, hidden 64, 4 heads (2 KV heads), tied embeddings
    (``param_dtype=None`` means float32).

    Initial weights are ``N(0, 1/64)`` (``1/sqrt(hidden)``), not the 0.02 of large models: at 0.02 a
    64-wide model's attention starts uniform over the ~500-token episode and supervised training sat
    on a plateau for hundreds of steps ignoring the map (greedy FrozenLake success 0 after 300 steps);
    at 0.125 it reads the map within 200 steps (greedy 0.77).
    """
    return ModelConfig(
        family="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_embeddings=True,
        max_position_embeddings=2048,
        param_dtype=param_dtype or "float32",
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.125,
    )
