"""Florence-2 phrase-grounding output (its documented format) → caption spans and boxes."""

import pytest

from mmcse.detection.grounding import TASK, clip_box, find_span, parse_grounding

CAPTION = "A green car parked in front of a yellow building."
# The documented result format of <CAPTION_TO_PHRASE_GROUNDING> after post_process_generation.
RECORDED = {TASK: {"bboxes": [[34.24, 160.08, 597.44, 371.76], [0.32, 0.48, 639.68, 281.04]],
                   "labels": ["A green car", "a yellow building"]}}


def test_recorded_example_maps_to_spans_and_pixel_boxes():
    pairs, dropped = parse_grounding(RECORDED, CAPTION, width=640, height=480)
    assert [(p.phrase, p.start, p.end) for p in pairs] == [("A green car", 0, 11), ("a yellow building", 31, 48)]
    assert [CAPTION[p.start : p.end] for p in pairs] == [p.phrase for p in pairs]
    assert pairs[0].box == (34, 160, 598, 372) and pairs[1].box == (0, 0, 640, 282)
    assert dropped == {"unmatched": 0, "bad_boxes": 0, "repeats": 0}


def test_labels_differing_in_case_spacing_and_punctuation_still_match():
    caption = "Two dogs, a brown dog and a white-and-black dog, play near a tree."
    output = {TASK: {"bboxes": [[1, 1, 5, 5], [6, 6, 9, 9], [2, 2, 3, 3]],
                     "labels": ["a White and black  dog", "A BROWN DOG", "tree"]}}
    pairs, _ = parse_grounding(output, caption, 10, 10)
    assert [p.phrase for p in pairs] == ["a brown dog", "a white-and-black dog", "tree"]  # caption order


def test_repeated_labels_take_successive_occurrences_then_extra_boxes_drop():
    caption = "a man talks to a man"
    output = {TASK: {"bboxes": [[0, 0, 4, 4], [5, 5, 9, 9], [1, 1, 2, 2]], "labels": ["a man", "a man", "a man"]}}
    pairs, dropped = parse_grounding(output, caption, 10, 10)
    assert [(p.start, p.end) for p in pairs] == [(0, 5), (15, 20)]
    assert dropped["repeats"] == 1


def test_unmatched_labels_and_bad_boxes_are_counted_not_fatal():
    output = {TASK: {"bboxes": [[5, 5, 5, 9], [0, 0, 3, 3], ["x", 0, 1, 1], [0, 0, 2, 2]],
                     "labels": ["a green car", "a red bus", "a yellow building", ""]}}
    pairs, dropped = parse_grounding(output, CAPTION, 640, 480)
    assert pairs == [] and dropped == {"unmatched": 2, "bad_boxes": 2, "repeats": 0}
    with pytest.raises(ValueError, match="2 boxes but 1 labels"):
        parse_grounding({TASK: {"bboxes": [[0, 0, 1, 1]] * 2, "labels": ["a"]}}, CAPTION, 10, 10)


def test_span_search_skips_taken_spans_and_matches_whole_words():
    assert find_span("a cart and a car", "a car", []) == (11, 16)  # not inside "a cart"
    assert find_span("a car and a car", "a car", [(0, 5)]) == (10, 15)
    assert find_span("a car", "a car", [(0, 5)]) is None


def test_boxes_are_clipped_and_ordered():
    assert clip_box([-5, -5, 700, 500], 640, 480) == (0, 0, 640, 480)
    assert clip_box([10.2, 20.7, 3.1, 4.0], 640, 480) == (3, 4, 11, 21)
    assert clip_box([float("nan"), 0, 1, 1], 640, 480) is None
    assert clip_box([700, 10, 800, 20], 640, 480) is None  # entirely outside
