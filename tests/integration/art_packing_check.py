"""ART's own packing code against training.session.packing.plan_sequences on random groups: the number of
packed sequences (ART: one optimizer step each) must be the same. Run with artweb's virtualenv;
openpipe-art 0.5.23's package is read from ``.venv-art23`` (its pack module needs torch and numpy,
which that virtualenv does not have). Prints ``<agreeing>/<cases> agree`` and each disagreement.

    python tests/integration/art_packing_check.py [seed] [cases]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.append(str(next((ROOT / ".venv-art23" / "lib").glob("python3*")) / "site-packages"))

import art  # noqa: E402  (after the path above)
from art.preprocessing.pack import packed_tensors_from_tokenized_results  # noqa: E402
from art.preprocessing.tokenize import TokenizedResult  # noqa: E402

from training.rollouts.trajectory import TrainSample  # noqa: E402
from training.session.packing import plan_sequences  # noqa: E402


def case(rng: random.Random) -> tuple[list[TrainSample], list[TokenizedResult], list[int]]:
    """Groups sharing a system prompt (none, shorter or longer than ART's 64-token sharing
    threshold), each a prompt and 2-8 completions, some starting alike."""
    samples, results = [], []
    system = [rng.randint(1000, 2000) for _ in range(rng.choice([0, 10, 63, 64, 90, 150]))]
    for group in range(rng.randint(1, 6)):
        prompt = system + [rng.randint(1000, 2000) for _ in range(rng.randint(1, 80))]
        for _ in range(rng.randint(2, 8)):
            completion = [7] * rng.choice([0, 0, 70]) + [
                rng.randint(1, 999) for _ in range(rng.randint(1, 80))
            ]
            samples.append(TrainSample(prompt_token_ids=prompt, completion_token_ids=completion,
                                       completion_logprobs=[-1.0] * len(completion), reward=0.0))  # fmt: skip
            tokens = prompt + completion
            results.append(
                TokenizedResult(
                    advantage=rng.choice([-1.0, 1.0]),
                    chat="",
                    token_ids=tokens,
                    input_pos=list(range(len(tokens))),
                    assistant_mask=[0] * len(prompt) + [1] * len(completion),
                    logprobs=[float("nan")] * len(prompt) + [-1.0] * len(completion),
                    pixel_values=None,
                    image_grid_thw=None,
                    choice_offsets=[len(prompt)],
                    extra_logprobs={},
                    _tokenizer=None,
                    trajectory=art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}]),
                    weight=1.0,
                    prompt_id=group,
                    prompt_length=len(prompt),
                )  # fmt: skip
            )
    return samples, results, [result.prompt_id for result in results]


def main(seed: int, cases: int) -> int:
    rng = random.Random(seed)
    agree = 0
    for number in range(cases):
        samples, results, groups = case(rng)
        longest = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
        seq_len = rng.randint(longest, longest * 4)
        ours = len(plan_sequences(samples, seq_len, groups=groups))
        theirs = packed_tensors_from_tokenized_results(
            results, seq_len, pad_token_id=0, truncate_long_results=False, pack_results=True, verbosity=0
        )["tokens"].shape[0]
        agree += ours == theirs
        if ours != theirs:
            print(f"case {number}: artweb {ours}, ART {theirs} sequences of {seq_len}")
    print(f"{agree}/{cases} agree")
    return 0 if agree == cases else 1


if __name__ == "__main__":
    sys.exit(
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, int(sys.argv[2]) if len(sys.argv) > 2 else 200)
    )
