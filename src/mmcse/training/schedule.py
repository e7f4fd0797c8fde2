"""An epoch's batch order by kind, as arithmetic: MCSE's alternation of text-only and image–caption
batches (`alternation_schedule`) and how many optimizer steps an epoch takes (`batches_per_epoch`), with
no tensor in sight, so a plan or an estimate knows a job's steps without loading torch."""

from __future__ import annotations

TEXT, PAIR = "text", "pair"


def alternation_schedule(n_text: int, n_pair: int) -> list[str]:
    """One epoch's batch kinds: after every ``n_text // n_pair`` text batches one pair batch.

    Text batches left over once the pair batches run out come at the end; with more
    pair than text batches (ratio 0) the kinds alternate until the text runs out.
    """
    if n_pair == 0:
        return [TEXT] * n_text
    ratio = max(n_text // n_pair, 1)
    schedule: list[str] = []
    text_left, pair_left = n_text, n_pair
    while text_left or pair_left:
        take = min(ratio, text_left)
        schedule += [TEXT] * take
        text_left -= take
        if pair_left:
            schedule.append(PAIR)
            pair_left -= 1
    return schedule


def full_batches(n_text_items: int, n_pair_items: int, batch_size: int) -> tuple[int, int]:
    """The full text and pair batches an epoch holds (the last, partial batch of each is dropped);
    a batch larger than both the corpus and the pairs is refused."""
    n_text, n_pair = n_text_items // batch_size, n_pair_items // batch_size
    if n_text + n_pair == 0:
        raise ValueError(
            f"train.batch_size={batch_size} exceeds both the corpus ({n_text_items}) and the pairs ({n_pair_items})"
        )
    return n_text, n_pair


def batches_per_epoch(n_text_items: int, n_pair_items: int, batch_size: int) -> int:
    """The optimizer steps of one epoch of `mmcse.training.batches.Batches` (one per batch of either kind)."""
    return len(alternation_schedule(*full_batches(n_text_items, n_pair_items, batch_size)))
