from pathlib import Path

import fsspec
import pytest

from app.catalog.catalog import Catalog, _storage_options, _store_options
from app.catalog.storage import DEFAULT_CONCURRENCY, DatasetRoot, _store_settings
from app.catalog.tables import load_tables
from app.runtime.errors import UserError
from conftest import REPO, write_catalog


def test_repo_catalog_has_the_documented_entries():
    catalog = Catalog.load(REPO / "datasets.toml")
    assert {"sample", "sample_tiny", "imagenet_local", "imagenet_s3"} <= set(catalog.names)
    assert catalog.default == "sample"
    assert catalog.entries["imagenet_s3"]["url"].startswith("s3://")


def test_sample_entry_is_generated_on_first_use(sample_cache):
    root = Catalog.load(REPO / "datasets.toml").open("sample_tiny")
    assert Path(root.url).parent == sample_cache
    assert root.exists("LOC_synset_mapping.txt") and root.image_size == 32


def test_missing_catalog(tmp_path):
    with pytest.raises(UserError, match=r"nope.toml: dataset catalog not found"):
        Catalog.load(tmp_path / "nope.toml")


def test_malformed_catalog_names_the_line(tmp_path):
    path = tmp_path / "datasets.toml"
    path.write_text('default = "a"\n\n[datasets.a]\nurl = /data\n')
    with pytest.raises(UserError) as error:
        Catalog.load(path)
    assert "datasets.toml: invalid TOML" in str(error.value) and "line 4" in str(error.value)


def test_unknown_dataset_lists_known_ones(tiny_sample, tmp_path):
    catalog = Catalog.load(write_catalog(tmp_path / "c.toml", {"one": {"url": str(tiny_sample)},
                                                               "two": {"sample": "tiny"}}))
    with pytest.raises(UserError, match=r"unknown dataset 'three' .*known: one, two"):
        catalog.open("three")


def test_missing_root_says_which_variable_to_set(tmp_path, monkeypatch):
    monkeypatch.delenv("MY_ROOT", raising=False)
    catalog = Catalog.load(write_catalog(tmp_path / "c.toml", {
        "local": {"url": str(tmp_path / "absent"), "url_env": "MY_ROOT"}}))
    with pytest.raises(UserError, match=r"root .*absent not found; set MY_ROOT or edit `url`"):
        catalog.open("local")


def test_environment_variable_overrides_url(tiny_sample, tmp_path, monkeypatch):
    catalog = Catalog.load(write_catalog(tmp_path / "c.toml", {
        "local": {"url": str(tmp_path / "absent"), "url_env": "MY_ROOT"}}))
    monkeypatch.setenv("MY_ROOT", str(tiny_sample))
    assert catalog.open("local").url == str(tiny_sample)


def test_relative_url_is_relative_to_the_catalog_file(tiny_sample, tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "data").symlink_to(tiny_sample)
    catalog = Catalog.load(write_catalog(tmp_path / "cfg" / "c.toml", {"d": {"url": "../data"}}))
    monkeypatch.chdir("/")
    assert catalog.open("d").exists("LOC_val_solution.csv")


def test_any_fsspec_url_works(tiny_sample, tmp_path):
    """A memory:// dataset (no local file at all) resolves to the same frames as the local one."""
    memory = fsspec.filesystem("memory")
    for name in ["LOC_synset_mapping.txt", "LOC_val_solution.csv", "LOC_train_solution.csv",
                 "ILSVRC/ImageSets/CLS-LOC/train_cls.txt"]:
        memory.pipe(f"/catalog-test/{name}", (tiny_sample / name).read_bytes())
    catalog = Catalog.load(write_catalog(tmp_path / "c.toml", {
        "mem": {"url": "memory://catalog-test"}, "local": {"url": str(tiny_sample)}}))
    in_memory = load_tables(catalog.open("mem"))
    local = load_tables(catalog.open("local"))
    assert in_memory.train.equals(local.train) and in_memory.val.equals(local.val)


@pytest.mark.parametrize("entry, fragment", [
    ({"url": "/x", "sample": "tiny"}, "exactly one of `url`"),
    ({}, "exactly one of `url`"),
    ({"sample": "huge"}, "unknown sample preset 'huge'"),
    ({"url": "/x", "regoin": "eu"}, "unknown key `regoin`"),
    ({"url": "/x", "anon": "yes"}, "`anon` has the wrong type"),
])
def test_bad_entries(tmp_path, entry, fragment):
    with pytest.raises(UserError, match=fragment):
        Catalog.load(write_catalog(tmp_path / "c.toml", {"bad": entry}))


def test_default_must_name_an_entry(tmp_path):
    with pytest.raises(UserError, match="default = 'b' is not an entry"):
        Catalog.load(write_catalog(tmp_path / "c.toml", {"a": {"sample": "tiny"}}, default="b"))


def test_s3_options_map_to_s3fs_and_carry_no_credentials():
    options = _storage_options("s3://bucket/imagenet", {
        "url": "s3://bucket/imagenet", "region": "eu-west-1", "profile": "research",
        "endpoint_url": "http://127.0.0.1:9000", "anon": True})
    assert {key: options[key] for key in ("endpoint_url", "profile", "client_kwargs", "anon")} == {
        "endpoint_url": "http://127.0.0.1:9000", "profile": "research",
        "client_kwargs": {"region_name": "eu-west-1"}, "anon": True}
    # Every request in flight needs its own pooled connection, and none may wait forever.
    assert options["config_kwargs"]["max_pool_connections"] == DEFAULT_CONCURRENCY
    assert options["config_kwargs"]["read_timeout"] > 0
    assert _storage_options("s3://b/p", {"concurrency": 8})["config_kwargs"][
        "max_pool_connections"] == 8
    secrets = ("key", "secret", "token", "aws_access_key_id", "aws_secret_access_key")
    assert not set(options) & set(secrets)
    assert _storage_options("/data/imagenet", {"region": "eu-west-1"}) == {}


def test_http_options_bound_a_stall_but_not_a_long_download_and_honour_the_proxy():
    """aiohttp's default would end every request after 5 minutes in all: an archive of a few
    hundred MB on a slow link takes longer."""
    client = _storage_options("https://example.org/imagenette2-320.tgz", {})["client_kwargs"]
    assert client["timeout"].total is None and client["timeout"].sock_read == 60
    assert client["timeout"].sock_connect == 30 and client["trust_env"] is True


def test_an_unreachable_root_whose_error_has_no_message(tmp_path, monkeypatch):
    """Clients raise errors with an empty message (a bare TimeoutError): still one line."""
    def time_out(self, relative=""):
        raise TimeoutError()
    monkeypatch.setattr(DatasetRoot, "exists", time_out)
    catalog = Catalog.load(write_catalog(tmp_path / "c.toml", {"far": {"url": "memory://x"}}))
    with pytest.raises(UserError, match=r"cannot reach memory://x \(TimeoutError\); check"):
        catalog.open("far")


@pytest.mark.parametrize("entry, fragment", [
    ({"url": "s3://b/p", "reader": "boto"}, "unknown reader 'boto'; known: obstore, s3fs"),
    ({"url": "/data/imagenet", "reader": "obstore"}, "reads only s3://, gs:// and az:// URLs"),
    ({"url": "gs://b/p", "reader": "s3fs"}, 'reader = "s3fs" reads only s3:// URLs'),
    ({"sample": "tiny", "reader": "s3fs"}, "reads only s3:// URLs"),
])
def test_bad_readers(tmp_path, entry, fragment):
    with pytest.raises(UserError, match=fragment):
        Catalog.load(write_catalog(tmp_path / "c.toml", {"bad": entry}))


def test_object_store_settings_carry_no_credentials_and_bound_every_request():
    entry = {"url": "s3://bucket/imagenet", "region": "eu-west-1", "profile": "research",
             "endpoint_url": "http://127.0.0.1:9000", "anon": True, "concurrency": 8,
             "cache_dir": "/cache"}
    assert _store_options(entry["url"], entry) == {
        "region": "eu-west-1", "profile": "research", "endpoint_url": "http://127.0.0.1:9000",
        "anon": True}
    assert _store_options("/data/imagenet", entry) == {}
    settings = _store_settings("s3", _store_options(entry["url"], entry))
    assert settings["config"] == {"skip_signature": True, "endpoint": "http://127.0.0.1:9000",
                                  "region": "eu-west-1"}
    assert "credential_provider" not in settings  # anonymous: nothing to sign with
    assert settings["client_options"]["allow_http"] is True  # the endpoint is http://
    assert settings["client_options"]["timeout"] and settings["client_options"]["connect_timeout"]
    assert settings["retry_config"]["max_retries"] >= 1
    assert _store_settings("gs", {"endpoint_url": "https://gcs.local"})["config"] == {
        "base_url": "https://gcs.local"}
    assert _store_settings("az", {"anon": True})["config"] == {"skip_signature": True}


def test_gs_and_az_roots_read_and_list_through_obstore(monkeypatch):
    """No gcsfs or adlfs needed: obstore's fsspec adapter lists, obstore's stores read, each
    with its own credential chain (nothing is requested here)."""
    from obstore.fsspec import FsspecStore
    from obstore.store import AzureStore, GCSStore
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "imagenetdp")
    gs = DatasetRoot("g", "gs://my-bucket/imagenet", store_options={"anon": True})
    az = DatasetRoot("a", "az://container/imagenet", store_options={"anon": True})
    assert isinstance(gs.store, GCSStore) and isinstance(az.store, AzureStore)
    assert gs.store.prefix == az.store.prefix == "imagenet"
    assert isinstance(gs.fs, FsspecStore) and gs.root == "my-bucket/imagenet"
    assert gs.reader == az.reader == "obstore" and not gs.is_local
    assert DatasetRoot("s", "s3://b/p", options={"reader": "s3fs"}).reader == "s3fs"
    assert DatasetRoot("l", "/data/imagenet").reader == "fsspec"
