import pytest


@pytest.fixture(scope="module")
def require_native():
    """Fail (not skip) when a native CPU kernel did not build: `make test` installs a C compiler."""

    def check(*modules):
        missing = [m.__name__ for m in modules if not m.available()]
        if missing:
            pytest.fail(f"native CPU kernels did not build: {missing} (a C compiler is part of `make test`'s setup)")

    return check
