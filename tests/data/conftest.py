from tests.data.served import server  # noqa: F401  (the fixture)
