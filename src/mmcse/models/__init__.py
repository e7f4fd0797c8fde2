"""Models: the student and its heads, DUET and VSE++, tokens, precision, devices, export."""
