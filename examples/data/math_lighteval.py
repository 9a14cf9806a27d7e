"""MATH (DigitalLearningGmbH/MATH-lighteval, the DAPO-on-MATH recipe's data) as verl-layout parquet.

    python examples/data/math_lighteval.py --out s3://$BUCKET/math

(Not named math.py: run as a script, its folder comes first on sys.path and it would shadow the standard
library's `math`.) The ground truth is the solution's last \\boxed{...}. yatt_ray's `math` reward sends a
data_source containing "math" to math-verify on the response's last \\boxed{...}, which the prompt asks for.
"""

from common import BOXED, run, verl_row

HUB_ID = "DigitalLearningGmbH/MATH-lighteval"


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) of `text`, nested braces kept; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    start = text.index("{", start)
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
    return None  # not closed


def to_verl(row: dict, split: str, index: int) -> dict:
    truth = last_boxed(row["solution"])
    if truth is None:
        raise ValueError(f"{split} row {index}: its solution has no \\boxed{{...}} answer")
    content = f"{row['problem']} {BOXED}"
    return verl_row(HUB_ID, content, truth, split, index, level=row["level"], type=row["type"])


def main(argv=None) -> dict:
    return run(to_verl, HUB_ID, __doc__, argv=argv)


if __name__ == "__main__":
    main()
