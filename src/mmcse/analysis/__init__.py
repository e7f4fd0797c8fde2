"""Tables of finished runs: rows and columns, significance, the papers' printed numbers, reports."""
