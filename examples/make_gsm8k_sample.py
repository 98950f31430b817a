"""Writes examples/gsm8k_sample.jsonl and examples/gsm8k_sample.parquet: 64 grade-school word
problems in GSM8K's answer format, generated here from templates with a fixed seed (nothing is
downloaded; the same files come out every time), and examples/gsm8k_sample_test.jsonl: 16 more,
none of them among the 64, held out for evaluation (configs/gsm8k.yaml's eval.path).

Each record has
  question  chat messages: one user message, the problem and how to give the answer
  answer    worked steps with calculator annotations (`48/2 = <<48/2=24>>24`) and a last line
            `#### <number>`, as in GSM8K
  id, topic passed to the reward as the record's extra columns

Use it with `data.path=examples/gsm8k_sample.parquet data.prompt_key=question data.answer_key=answer`
(docs/data.md).

    python examples/make_gsm8k_sample.py [OUT_DIR]
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

SEED = 12
RECORDS, TEST_RECORDS = 64, 16
INSTRUCTION = 'Solve the problem step by step, then give the final answer on its own last line as "#### <number>".'
NAMES = [("Maya", "she", "her"), ("Omar", "he", "his"), ("Lena", "she", "her"), ("Tariq", "he", "his"),
         ("Ines", "she", "her"), ("Kofi", "he", "his"), ("Priya", "she", "her"), ("Jonas", "he", "his")]


def step(expr: str, value: int, text: str) -> str:
    """One GSM8K solution line: `text` with the calculation in its `{}`."""
    return text.format(f"{expr} = <<{expr}={value}>>{value}")


def change(rng: random.Random) -> tuple[str, list[str], int]:
    (name, he, _), item = rng.choice(NAMES), rng.choice(["notebooks", "pencil cases", "sandwiches", "comic books"])
    count, price = rng.randint(2, 6), rng.randint(2, 9)
    cost = count * price
    bill = next(b for b in (10, 20, 50, 100) if b > cost)
    question = (f"{name} buys {count} {item} that cost ${price} each and pays with a ${bill} bill. "
                f"How much change does {he} get?")
    return question, [step(f"{count}*{price}", cost, f"The {item} cost {{}} dollars."),
                      step(f"{bill}-{cost}", bill - cost, "The change is {} dollars.")], bill - cost


def sharing(rng: random.Random) -> tuple[str, list[str], int]:
    (name, he, _), thing = rng.choice(NAMES), rng.choice(["stickers", "marbles", "cookies", "cards"])
    friends, each = rng.randint(2, 6), rng.randint(2, 7)
    total = friends * each + rng.randint(1, 15)
    given = friends * each
    question = (f"{name} has {total} {thing}. {he.capitalize()} gives {each} {thing} to each of {friends} "
                f"friends. How many {thing} does {he} have left?")
    return question, [step(f"{friends}*{each}", given, f"{name} gives away {{}} {thing}."),
                      step(f"{total}-{given}", total - given, f"{he.capitalize()} has {{}} {thing} left.")], total - given


def reading(rng: random.Random) -> tuple[str, list[str], int]:
    name, _, his = rng.choice(NAMES)
    per_day, days = rng.randint(8, 30), rng.randint(3, 9)
    read = per_day * days
    pages = read + rng.randint(10, 120)
    question = (f"{name}'s book has {pages} pages. {name} reads {per_day} pages every day. How many pages "
                f"are left after {days} days?")
    return question, [step(f"{per_day}*{days}", read, f"In {days} days {name} reads {{}} pages."),
                      step(f"{pages}-{read}", pages - read, f"There are {{}} pages left in {his} book.")], pages - read


def saving(rng: random.Random) -> tuple[str, list[str], int]:
    name, _, his = rng.choice(NAMES)
    weekly, weeks, start = rng.randint(4, 25), rng.randint(3, 12), rng.randint(0, 40)
    target = start + weekly * weeks
    question = (f"{name} wants a bike that costs ${target}. {name} already has ${start} and saves ${weekly} "
                "every week. How many weeks does it take to have enough money?")
    return question, [step(f"{target}-{start}", target - start, f"{name} still needs {{}} dollars."),
                      step(f"{target - start}/{weekly}", weeks, f"Saving {weekly} a week takes {{}} weeks "
                           f"for {his} bike.")], weeks


def farm(rng: random.Random) -> tuple[str, list[str], int]:
    cows, hens = rng.randint(3, 20), rng.randint(5, 40)
    question = f"A farm has {cows} cows and {hens} chickens. How many legs do the animals have altogether?"
    return question, [step(f"{cows}*4", cows * 4, "The cows have {} legs."),
                      step(f"{hens}*2", hens * 2, "The chickens have {} legs."),
                      step(f"{cows * 4}+{hens * 2}", cows * 4 + hens * 2, "Altogether there are {} legs.")], \
        cows * 4 + hens * 2


def halves(rng: random.Random) -> tuple[str, list[str], int]:
    (name, he, _), thing = rng.choice(NAMES), rng.choice(["shells", "stamps", "beads", "coins"])
    had, found = 2 * rng.randint(6, 40), rng.randint(2, 25)
    kept = had // 2
    question = (f"{name} had {had} {thing} and lost half of them. Then {he} found {found} more. How many "
                f"{thing} does {he} have now?")
    return question, [step(f"{had}/2", kept, f"After losing half, {name} has {{}} {thing}."),
                      step(f"{kept}+{found}", kept + found, f"Now {he} has {{}} {thing}.")], kept + found


def bakery(rng: random.Random) -> tuple[str, list[str], int]:
    batches, per_batch = rng.randint(2, 8), rng.choice([6, 8, 12, 24])
    made = batches * per_batch
    sold = rng.randint(1, made - 1)
    question = (f"A baker makes {batches} batches of muffins with {per_batch} muffins in each batch. "
                f"She sells {sold} muffins. How many muffins are left?")
    return question, [step(f"{batches}*{per_batch}", made, "The baker makes {} muffins."),
                      step(f"{made}-{sold}", made - sold, "There are {} muffins left.")], made - sold


def trip(rng: random.Random) -> tuple[str, list[str], int]:
    speed1, hours1, speed2, hours2 = rng.randint(30, 70), rng.randint(1, 4), rng.randint(20, 60), rng.randint(1, 3)
    first, second = speed1 * hours1, speed2 * hours2
    question = (f"A car drives at {speed1} miles per hour for {hours1} hours, then at {speed2} miles per hour "
                f"for {hours2} hours. How many miles does it drive in total?")
    return question, [step(f"{speed1}*{hours1}", first, "First it drives {} miles."),
                      step(f"{speed2}*{hours2}", second, "Then it drives {} miles."),
                      step(f"{first}+{second}", first + second, "In total it drives {} miles.")], first + second


TOPICS: dict[str, Callable[[random.Random], tuple[str, list[str], int]]] = {
    "change": change, "sharing": sharing, "reading": reading, "saving": saving,
    "farm": farm, "halves": halves, "bakery": bakery, "trip": trip,
}


def records(seed: int = SEED, count: int = RECORDS) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        topic = list(TOPICS)[i % len(TOPICS)]
        question, steps, final = TOPICS[topic](rng)
        out.append({"id": f"sample-{i:03d}", "topic": topic,
                    "question": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
                    "answer": "\n".join([*steps, f"#### {final}"])})
    return out


def main(out_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # The test records continue the training records' stream: the training files stay as they were.
    rows = records(count=RECORDS + TEST_RECORDS)
    rows, test = rows[:RECORDS], rows[RECORDS:]
    for name, part in (("gsm8k_sample.jsonl", rows), ("gsm8k_sample_test.jsonl", test)):
        with open(out_dir / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
    pq.write_table(pa.Table.from_pylist(rows), out_dir / "gsm8k_sample.parquet")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
