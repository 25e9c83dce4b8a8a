"""One reading of a failed request (app/catalog/retry.py's `failure`), phrased by each caller
its own way: a missing key, a request refused (an unsigned one to the loopback S3 server's
private bucket: 403) and an endpoint nothing answers, through the fetcher (fsspec and obstore),
the run folder's bucket check, and the image readers (s3fs and obstore)."""

from __future__ import annotations

import pytest

from app.catalog import fetcher
from app.catalog.remote_run import RemoteRunFolder
from app.catalog.storage import DatasetRoot
from app.data.reader import BlobReader
from app.runtime.errors import UserError

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused
ONE_TRY = {"retries": {"max_attempts": 1}}  # botocore's waits would only make the test wait


def root(url: str, endpoint: str, reader: str, anon: bool) -> DatasetRoot:
    """`url` read as a dataset entry with `reader` reads it (a fetch: whole files alike)."""
    access = {"anon": True} if anon else {}
    return DatasetRoot("d", url, {"endpoint_url": endpoint, "config_kwargs": ONE_TRY, **access},
                       options={"reader": reader},
                       store_options={"endpoint_url": endpoint, "region": "us-east-1", **access})


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    client = s3_server.client()
    client.create_bucket(Bucket="failing")  # private: an unsigned request is refused
    client.put_object(Bucket="failing", Key="data/there.jpg", Body=b"not read")
    return s3_server.endpoint


# case -> (endpoint, key read, the run folder's bucket, unsigned), then what each caller says
CASES = {
    "missing": ("moto", "gone.jpg", "failing-nonexistent", False),
    "denied": ("moto", "there.jpg", "failing", True),
    "unreachable": (NOWHERE, "there.jpg", "failing", False),
}
FETCHES = {"missing": "{url} not found; check the URL",
           "denied": "cannot download {url}: access denied (",
           "unreachable": "cannot download {url} ("}
REFUSALS = {"missing": "(no such bucket or key: ", "denied": "(403 access denied: ",
            "unreachable": "Error: "}
SKIPS = {"missing": "missing", "denied": "access denied",
         "unreachable": "unreadable after 5 attempts: "}


@pytest.mark.parametrize("case", CASES)
def test_a_failed_request_is_told_alike_by_every_caller(bucket, case, tmp_path):
    endpoint, key, run_bucket, anon = CASES[case]
    endpoint = bucket if endpoint == "moto" else endpoint
    url = f"s3://failing/data/{key}"
    for reader in ("s3fs", "obstore"):
        source = root("s3://failing/data", endpoint, reader, anon)
        with pytest.raises(fetcher.FetchError) as fetched:
            fetcher.fetch(source, "models", key, cache=tmp_path)
        assert str(fetched.value).startswith(FETCHES[case].format(url=url)), (reader, fetched)
        assert isinstance(fetched.value, fetcher.NotFound) == (case == "missing")
        [(data, reason)] = BlobReader(source).read_many([key])
        assert data is None and reason.startswith(SKIPS[case]), (reader, reason)
        assert case != "unreachable" or reason != SKIPS[case]  # the client's words follow
    folder = RemoteRunFolder(root(f"s3://{run_bucket}/runs/r", endpoint, "s3fs", anon))
    with pytest.raises(UserError) as refused:
        folder.check_writable()
    said = str(refused.value)
    assert said.startswith(f"--output-dir: cannot write s3://{run_bucket}/runs/r ")
    assert REFUSALS[case] in said, said
