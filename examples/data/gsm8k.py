"""GSM8K (openai/gsm8k, config "main") as verl-layout parquet: train.parquet and test.parquet in --out.

    python examples/data/gsm8k.py --out s3://$BUCKET/gsm8k

The ground truth is the number after the answer's "####" (commas removed). yatt_ray's `math` reward scores the
data_source "openai/gsm8k" by the number after the response's last "####", which the prompt asks for.
"""

from common import run, verl_row

HUB_ID = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def final_number(answer: str) -> str:
    """The number after the last "####", commas removed: "... #### 1,234" -> "1234"."""
    if "####" not in answer:
        raise ValueError(f"a GSM8K answer ends with '#### <number>'; this one does not: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def to_verl(row: dict, split: str, index: int) -> dict:
    question, answer = row["question"], row["answer"]
    content = f"{question} {INSTRUCTION}"
    return verl_row(HUB_ID, content, final_number(answer), split, index, answer=answer, question=question)


def main(argv=None) -> dict:
    return run(to_verl, HUB_ID, __doc__, config="main", argv=argv)


if __name__ == "__main__":
    main()
