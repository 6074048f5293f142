"""Code the tests use that is not a test: stand-ins, fault drivers, scoring functions and model builders."""
