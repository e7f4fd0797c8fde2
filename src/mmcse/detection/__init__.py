"""Detected image regions: region features with their boxes (DUET §4.1.1's r_i, b_i), read from
published bottom-up-attention files or encoded from the detect stage's objects, cached once."""
