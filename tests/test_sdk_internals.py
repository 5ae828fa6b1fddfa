"""The SDKs' internals we lean on, against the versions installed (the locks pin them): an upgrade
that moves one fails here, naming it, instead of deep inside a run. No network: nothing is sent."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import requests
from aistore.sdk import Client
from aistore.sdk.response_handler import AISResponseHandler
from aistore.sdk.retry_config import RetryConfig
from tenacity import Retrying
from webdataset.filters import shuffle
from webdataset.tariterators import group_by_keys

CLIENT = Client("http://127.0.0.1:9")  # nothing listens there, and nothing is sent
OBJECT = CLIENT.bucket("b").object("o")


def _put_on_target() -> None:  # storage/ais.py: the PUT sent straight to the target
    client = CLIENT.bucket("b").client
    assert isinstance(client.session_manager.session, requests.Session)
    assert client.token is None and client.timeout
    assert callable(AISResponseHandler().handle_response)


def _resuming_get() -> None:  # storage/ais.py: urllib3's streaming response of a ranged GET
    assert callable(OBJECT.get_reader(byte_range="bytes=5-").raw)


def _multipart() -> None:  # storage/ais.py: each part's URL, then the part PUT to its target
    upload = OBJECT.multipart_upload()
    assert all(callable(getattr(upload, name)) for name in ("create", "add_part", "complete", "abort"))
    assert hasattr(upload, "object_path") and hasattr(upload, "client")
    assert (
        upload.client.get_full_url("objects/b/o", {"partNumber": 1}) == "http://127.0.0.1:9/v1/objects/b/o?partNumber=1"
    )


def _quiet_retries() -> None:  # storage/ais.py: the SDK's network retries without their logging
    policy = RetryConfig.default()
    assert isinstance(policy.network_retry, Retrying)
    quiet = policy.network_retry.copy(before_sleep=None, retry_error_callback=None, reraise=True)
    assert quiet.before_sleep is None and quiet.reraise
    assert "retry_config" in inspect.signature(Client).parameters


def _group_by_keys() -> None:  # worker.py: samples from a tar's members, errors to a handler
    errors: list[Exception] = []
    files = [{"fname": "k0.jpg", "data": b"j", "__url__": "u"}, {"fname": "k0.cls", "data": b"1", "__url__": "u"}]
    assert list(group_by_keys(iter(files), handler=errors.append)) == [
        {"__key__": "k0", "__url__": "u", "jpg": b"j", "cls": b"1"}
    ]
    assert not errors


def _shuffle() -> None:  # worker.py: a seeded buffer shuffle as a pipeline stage
    stage = shuffle(4, 4, seed=1)
    assert sorted(stage(iter(range(10)))) == list(range(10))


INTERNALS: dict[str, Callable[[], None]] = {
    "aistore: RequestClient.session_manager.session, .token, .timeout; AISResponseHandler.handle_response": (
        _put_on_target
    ),
    "aistore: Object.get_reader(byte_range=...).raw": _resuming_get,
    "aistore: MultipartUpload create/add_part/complete/abort, .object_path, .client.get_full_url": _multipart,
    "aistore: RetryConfig.default().network_retry (a tenacity Retrying), Client(retry_config=...)": _quiet_retries,
    "webdataset: tariterators.group_by_keys(files, handler=...)": _group_by_keys,
    "webdataset: filters.shuffle(bufsize, initial, seed=...)": _shuffle,
}


@pytest.mark.parametrize("internal", list(INTERNALS))
def test_the_sdk_internals_we_use_are_where_we_use_them(internal: str) -> None:
    try:
        INTERNALS[internal]()
    except Exception as e:  # (AssertionError included)
        pytest.fail(f"{internal} moved or changed ({type(e).__name__}: {e}): adapt the code that uses it")
