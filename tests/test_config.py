"""Specification of pyalloc.config: PyTorch's allocator configuration strings, better errors."""

import gc
import gzip
import json
import pickle
import sys
import weakref
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

try:
    from pyalloc import config
except ImportError:
    # pyalloc/__init__.py imports the compiled core; config.py itself is pure Python, so load it by
    # path when the package cannot be imported (no build yet).
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "pyalloc_config_standalone", Path(__file__).resolve().parents[1] / "pyalloc" / "config.py")
    config = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = config
    _spec.loader.exec_module(config)

ConfigError = config.ConfigError
Cuda = config.CudaAllocatorConfig
from units import MiB
SIZE_MAX = 2**64 - 1
TRACES = Path(__file__).resolve().parent / "data"     # PyTorch traces (tests/data/README.md)
TRACE_FILES = sorted(TRACES.glob("*.pickle.gz"))


def parse_error(text, cls=None):
    with pytest.raises(ConfigError) as info:
        (cls or Cuda)(text)
    return info.value


def non_default_config():
    """A config where every setting differs from its default, to show what a parse changes."""
    return Cuda("max_split_size_mb:256,max_non_split_rounding_mb:64,"
                "garbage_collection_threshold:0.7,"
                "roundup_power2_divisions:[256:1,>:4],expandable_segments:True,"
                "pinned_use_background_threads:True,release_lock_on_cudamalloc:True,"
                "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
                "pinned_reserve_segment_size_mb:32,graph_capture_record_stream_reuse:True,"
                "per_process_memory_fraction:0.5")


@pytest.fixture
def process_settings(monkeypatch):
    """Fresh process-wide settings and listeners, with no config variable in the environment."""
    for name in config.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(config, "_process_settings", None)
    monkeypatch.setattr(config, "_listeners", [])


# -- defaults --------------------------------------------------------------------------------------

@pytest.mark.parametrize("attribute, default", [
    ("max_split_size", SIZE_MAX),
    ("max_non_split_rounding_size", 20 * MiB),
    ("garbage_collection_threshold", 0.0),
    ("roundup_power2_divisions", [0] * 16),
    ("expandable_segments", False),
    ("pinned_use_background_threads", False),
    ("last_settings_string", ""),
    ("backend", "native"),
    ("release_lock_on_cudamalloc", False),
    ("pinned_use_cuda_host_register", False),
    ("pinned_num_register_threads", 1),
    ("pinned_reserve_segment_size_mb", 0),
    ("graph_capture_record_stream_reuse", False),
    ("per_process_memory_fraction", 1.0),
])
def test_defaults_are_pytorchs(attribute, default):
    assert getattr(Cuda(), attribute) == default


@pytest.mark.parametrize("text", ["", "   ", "\t\n "])
def test_empty_or_blank_string_gives_defaults(text):
    cfg = Cuda(text)
    assert cfg.last_settings_string == text
    cfg.last_settings_string = ""
    assert cfg == Cuda()


# -- every key, good values ------------------------------------------------------------------------

@pytest.mark.parametrize("text, attribute, expected", [
    ("max_split_size_mb:20", "max_split_size", 20 * MiB),
    ("max_split_size_mb:128", "max_split_size", 128 * MiB),
    ("max_split_size_mb:0128", "max_split_size", 128 * MiB),
    (f"max_split_size_mb:{2**44 - 1}", "max_split_size", (2**44 - 1) * MiB),
    (f"max_split_size_mb:{2**44}", "max_split_size", SIZE_MAX),      # clamped: unlimited
    (f"max_split_size_mb:{SIZE_MAX}", "max_split_size", SIZE_MAX),
    ("max_non_split_rounding_mb:20", "max_non_split_rounding_size", 20 * MiB),
    ("max_non_split_rounding_mb:64", "max_non_split_rounding_size", 64 * MiB),
    ("garbage_collection_threshold:0.5", "garbage_collection_threshold", 0.5),
    ("garbage_collection_threshold:.25", "garbage_collection_threshold", 0.25),
    ("garbage_collection_threshold:5e-1", "garbage_collection_threshold", 0.5),
    ("garbage_collection_threshold:0.999", "garbage_collection_threshold", 0.999),
    ("roundup_power2_divisions:1", "roundup_power2_divisions", [1] * 16),
    ("roundup_power2_divisions:4", "roundup_power2_divisions", [4] * 16),
    ("roundup_power2_divisions:32", "roundup_power2_divisions", [32] * 16),
    ("expandable_segments:True", "expandable_segments", True),
    ("expandable_segments:False", "expandable_segments", False),
    ("pinned_use_background_threads:True", "pinned_use_background_threads", True),
    ("backend:native", "backend", "native"),
    ("release_lock_on_cudamalloc:True", "release_lock_on_cudamalloc", True),
    ("release_lock_on_hipmalloc:True", "release_lock_on_cudamalloc", True),
    ("pinned_use_cuda_host_register:True", "pinned_use_cuda_host_register", True),
    ("pinned_use_hip_host_register:True", "pinned_use_cuda_host_register", True),
    ("pinned_num_register_threads:1", "pinned_num_register_threads", 1),
    ("pinned_num_register_threads:8", "pinned_num_register_threads", 8),
    ("pinned_num_register_threads:128", "pinned_num_register_threads", 128),
    ("pinned_reserve_segment_size_mb:1", "pinned_reserve_segment_size_mb", 1),
    ("pinned_reserve_segment_size_mb:64", "pinned_reserve_segment_size_mb", 64),
    ("graph_capture_record_stream_reuse:True", "graph_capture_record_stream_reuse", True),
    ("per_process_memory_fraction:0.0", "per_process_memory_fraction", 0.0),
    ("per_process_memory_fraction:0.5", "per_process_memory_fraction", 0.5),
    ("per_process_memory_fraction:1", "per_process_memory_fraction", 1.0),
    ("event_poll_streams:0", "event_poll_streams", 0),
    ("event_poll_streams:8", "event_poll_streams", 8),
])
def test_key_accepts_good_value(text, attribute, expected):
    assert getattr(Cuda(text), attribute) == expected


# -- every key, bad values: (string, position of the offending token, its text, message fragment) --

@pytest.mark.parametrize("text, position, token, fragment", [
    ("max_split_size_mb:19", 18, "19", "max_split_size_mb too small, must be >= 20"),
    ("max_split_size_mb:0", 18, "0", "must be >= 20"),
    ("max_split_size_mb:-1", 18, "-1", "expected a non-negative integer"),
    ("max_split_size_mb:+128", 18, "+128", "expected a non-negative integer"),
    ("max_split_size_mb:1.5", 18, "1.5", "expected a non-negative integer"),
    ("max_split_size_mb:abc", 18, "abc", "expected a non-negative integer"),
    ("max_split_size_mb:True", 18, "True", "expected a non-negative integer"),
    (f"max_split_size_mb:{2**64}", 18, str(2**64), "out of range"),
    ("max_split_size_mb:" + "9" * 5000, 18, "9" * 5000, "out of range"),
    ("max_non_split_rounding_mb:19", 26, "19",
     "max_non_split_rounding_mb too small, must be >= 20"),
    ("max_non_split_rounding_mb:x", 26, "x", "expected a non-negative integer"),
    ("garbage_collection_threshold:0", 29, "0", "must be in (0.0, 1.0)"),
    ("garbage_collection_threshold:1.0", 29, "1.0", "must be in (0.0, 1.0)"),
    ("garbage_collection_threshold:-0.5", 29, "-0.5", "must be in (0.0, 1.0)"),
    ("garbage_collection_threshold:abc", 29, "abc", "expected a number"),
    ("garbage_collection_threshold:nan", 29, "nan", "expected a number"),
    ("garbage_collection_threshold:inf", 29, "inf", "expected a number"),
    ("garbage_collection_threshold:0.5.1", 29, "0.5.1", "expected a number"),
    ("roundup_power2_divisions:0", 25, "0", "power of 2"),
    ("roundup_power2_divisions:3", 25, "3", "power of 2"),
    ("roundup_power2_divisions:-4", 25, "-4", "expected a non-negative integer"),
    ("expandable_segments:true", 20, "true", "expected 'True' or 'False'"),
    ("expandable_segments:1", 20, "1", "expected 'True' or 'False'"),
    ("expandable_segments:TRUE", 20, "TRUE", "expected 'True' or 'False'"),
    ("pinned_use_background_threads:yes", 30, "yes", "expected 'True' or 'False'"),
    ("backend:cudaMallocAsync", 8, "cudaMallocAsync", "pyalloc implements only the native backend"),
    ("backend:Native", 8, "Native", "expected 'native' or 'cudaMallocAsync'"),
    ("release_lock_on_cudamalloc:1", 27, "1", "expected 'True' or 'False'"),
    ("pinned_use_cuda_host_register:0", 30, "0", "expected 'True' or 'False'"),
    ("pinned_num_register_threads:3", 28, "3", "has to be a power of 2"),
    ("pinned_num_register_threads:0", 28, "0", "has to be a power of 2"),
    ("pinned_num_register_threads:256", 28, "256", "less than or equal to 128"),
    ("pinned_num_register_threads:True", 28, "True", "expected a non-negative integer"),
    ("pinned_reserve_segment_size_mb:0", 31, "0", "greater than 0"),
    ("pinned_reserve_segment_size_mb:-1", 31, "-1", "expected a non-negative integer"),
    ("graph_capture_record_stream_reuse:false", 34, "false", "expected 'True' or 'False'"),
    ("per_process_memory_fraction:1.5", 28, "1.5", "must be in [0.0, 1.0]"),
    ("per_process_memory_fraction:-0.1", 28, "-0.1", "must be in [0.0, 1.0]"),
    ("per_process_memory_fraction:half", 28, "half", "expected a number"),
    ("event_poll_streams:4294967296", 19, "4294967296", "must be below 2**32"),
    ("event_poll_streams:-1", 19, "-1", "expected a non-negative integer"),
])
def test_key_rejects_bad_value(text, position, token, fragment):
    err = parse_error(text)
    assert (err.position, err.token) == (position, token)
    assert fragment in err.reason


def test_bool_error_says_expected_true_or_false():
    assert "expected 'True' or 'False'" in str(parse_error("expandable_segments:true"))


# -- roundup_power2_divisions ---------------------------------------------------------------------

def test_list_form_fills_buckets_as_in_pytorchs_example():
    divisions = Cuda("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions
    assert divisions == [1] * 9 + [2, 4] + [8] * 5


@pytest.mark.parametrize("text, expected", [
    ("[1:4]", [4] + [0] * 15),                        # bucket 0: nothing below it to fill
    ("[64:2]", [2] * 7 + [0] * 9),                    # first entry fills the buckets below it
    ("[64:2,128:4]", [2] * 7 + [4] + [0] * 8),        # later entries set only their own bucket
    ("[>:8]", [0] + [8] * 15),                        # '>' alone fills after bucket 0, as PyTorch
    ("[256:0,>:4]", [0] * 9 + [4] * 7),               # 0 disables rounding for a bucket
    ("[32768:2]", [2] * 16),                          # bucket 15
    ("[65536:2]", [2] * 16),                          # above 32 GiB clamps to bucket 15
    ("[512:2,256:1]", [2] * 8 + [1, 2] + [0] * 6),    # out of order: PyTorch's result
    ("[256:1,256:2]", [1] * 8 + [2] + [0] * 7),       # same interval twice: the later wins
    ("[256:1,]", [1] * 9 + [0] * 7),                  # trailing comma, as PyTorch accepts
    ("[ 256 : 1 , > : 8 ]", [1] * 9 + [8] * 7),       # whitespace is dropped
])
def test_list_form_bucket_filling(text, expected):
    assert Cuda("roundup_power2_divisions:" + text).roundup_power2_divisions == expected


@pytest.mark.parametrize("text, position, token, fragment", [
    ("[]", 26, "]", "empty list"),
    ("[256:1", 31, "", "expected ',' or ']'"),
    ("[256:1,512:2", 37, "", "expected ',' or ']'"),
    ("[256:1:2]", 31, ":", "expected ',' or ']'"),
    ("[300:1]", 26, "300", "intervals have to be powers of 2"),
    ("[0:1]", 26, "0", "intervals have to be powers of 2"),
    ("[abc:1]", 26, "abc", "expected a non-negative integer"),
    ("[256:3]", 30, "3", "power of 2 or 0"),
    ("[256:x]", 30, "x", "expected a non-negative integer"),
    ("[256]", 29, "]", "expected ':' after interval '256'"),
    ("[:1]", 26, ":", "expected an interval start"),
    ("[>:8,256:1]", 26, ">", "'>:M' must be the last entry"),
    ("[>:8", 29, "", "expected ']' to close the list"),
    ("[256 1]", 31, "]", "expected ':' after interval '2561'"),
])
def test_list_form_rejects_malformed_list(text, position, token, fragment):
    err = parse_error("roundup_power2_divisions:" + text)
    assert (err.position, err.token) == (position, token)
    assert fragment in err.reason


def test_single_form_sets_all_buckets():
    assert Cuda("roundup_power2_divisions:8").roundup_power2_divisions == [8] * 16


@pytest.mark.parametrize("size, expected_bucket", [
    (0, 0), (512, 0), (1 * MiB, 0), (2 * MiB - 1, 0), (2 * MiB, 1),
    (256 * MiB, 8), (512 * MiB, 9), (1024 * MiB, 10), (32768 * MiB, 15), (2**40, 15),
])
def test_roundup_power2_divisions_for_picks_bucket_floor_log2_minus_20(size, expected_bucket):
    cfg = Cuda("roundup_power2_divisions:[1:1,2:2,4:4,8:8,16:16,32:32,64:64,128:128,256:256,"
               "512:512,1024:1024,2048:2048,4096:4096,8192:8192,16384:16384,32768:32768]")
    assert cfg.roundup_power2_divisions_for(size) == 1 << expected_bucket


# -- reparse, atomicity, value behaviour -----------------------------------------------------------

def test_reparse_resets_max_split_but_keeps_expandable_segments():
    cfg = Cuda("max_split_size_mb:128,expandable_segments:True")
    cfg.parse("garbage_collection_threshold:0.5")
    assert cfg.max_split_size == SIZE_MAX
    assert cfg.expandable_segments is True


def test_reparse_resets_roundup_and_garbage_collection_threshold():
    cfg = Cuda("roundup_power2_divisions:4,garbage_collection_threshold:0.5")
    cfg.parse("expandable_segments:False")
    assert (cfg.roundup_power2_divisions, cfg.garbage_collection_threshold) == ([0] * 16, 0.0)


def test_reparse_keeps_every_other_setting():
    cfg = non_default_config()
    cfg.parse("")
    kept = {k: v for k, v in vars(non_default_config()).items()
            if k not in ("max_split_size", "roundup_power2_divisions",
                         "garbage_collection_threshold", "last_settings_string")}
    assert {k: vars(cfg)[k] for k in kept} == kept


def test_parse_records_last_settings_string_verbatim():
    text = " expandable_segments : True "
    assert Cuda(text).last_settings_string == text


@pytest.mark.parametrize("text", [
    "max_split_size_mb:10",
    "expandable_segments:False,max_split_size_mb:1",            # the first setting was valid
    "pinned_num_register_threads:2,roundup_power2_divisions:[256:1",
    "garbage_collection_threshold:0.1,bogus:1",
    "max_split_size_mb:128,max_split_size_mb:256",
])
def test_failed_parse_leaves_config_unchanged(text):
    cfg = non_default_config()
    with pytest.raises(ConfigError):
        cfg.parse(text)
    assert cfg == non_default_config()


def test_trailing_comma_is_accepted():
    assert Cuda("expandable_segments:True,").expandable_segments is True


def test_whitespace_inside_a_word_is_dropped():
    assert Cuda("max_split _size_mb : 1 28").max_split_size == 128 * MiB


def test_parse_rejects_non_string():
    with pytest.raises(TypeError):
        Cuda().parse(None)


def test_copy_shares_no_list():
    cfg = Cuda("roundup_power2_divisions:4")
    other = cfg.copy()
    other.roundup_power2_divisions[0] = 8
    assert cfg.roundup_power2_divisions == [4] * 16


def test_equality_compares_settings():
    assert Cuda("expandable_segments:True") == Cuda("expandable_segments:True")
    assert Cuda("expandable_segments:True") != Cuda("expandable_segments:False")


def test_repr_names_class_and_settings():
    text = repr(Cuda("max_split_size_mb:128"))
    assert text.startswith("CudaAllocatorConfig(") and f"max_split_size={128 * MiB}" in text


# -- malformed strings: position and token of the error --------------------------------------------

@pytest.mark.parametrize("text, position, token, fragment", [
    # missing ':'
    ("expandable_segments,True", 19, ",", "expected ':' after 'expandable_segments'"),
    ("expandable_segments", 19, "", "expected ':' after 'expandable_segments' but reached the end"),
    ("expandable_segmentsTrue", 0, "expandable_segmentsTrue",
     "did you mean 'expandable_segments'?"),
    # missing ',' (whitespace is dropped, so a space does not separate settings)
    ("max_split_size_mb:128expandable_segments:True", 18, "128expandable_segments",
     "missing ',' before 'expandable_segments'?"),
    ("max_split_size_mb:128 expandable_segments:True", 18, "128expandable_segments",
     "whitespace is ignored"),
    ("expandable_segments:True garbage_collection_threshold:0.5", 20,
     "Truegarbage_collection_threshold", "missing ',' before 'garbage_collection_threshold'?"),
    ("expandable_segments:True:False", 24, ":", "expected ',' between settings"),
    # missing value
    ("expandable_segments:", 20, "", "reached the end of the config"),
    ("max_split_size_mb:,expandable_segments:True", 18, ",", "expected a non-negative integer"),
    # unbalanced brackets
    ("roundup_power2_divisions:[256:1", 31, "", "expected ',' or ']'"),
    ("roundup_power2_divisions:256:1]", 28, ":", "expected ',' between settings"),
    ("expandable_segments:True]", 24, "]", "expected ',' between settings"),
    ("[expandable_segments:True]", 0, "[", "expected a key"),
    # unknown keys, with the closest known key
    ("max_split_size:128", 0, "max_split_size", "did you mean 'max_split_size_mb'?"),
    ("expandable_segment:True", 0, "expandable_segment", "did you mean 'expandable_segments'?"),
    ("zzz:1", 0, "zzz", "known keys: backend,"),
    # duplicate keys, aliases included
    ("max_split_size_mb:128,max_split_size_mb:256", 22, "max_split_size_mb", "given twice"),
    ("release_lock_on_cudamalloc:True,release_lock_on_hipmalloc:False", 32,
     "release_lock_on_hipmalloc", "given twice"),
    # '>' outside a list
    (">:8", 0, ">", "'>' is only valid inside a list"),
    ("roundup_power2_divisions:>", 25, ">", "'>' is only valid inside a list"),
    ("roundup_power2_divisions:>:8", 25, ">", "'>' is only valid inside a list"),
    # empty settings
    (",expandable_segments:True", 0, ",", "expected a key"),
    ("expandable_segments:True,,max_split_size_mb:128", 25, ",", "expected a key"),
])
def test_malformed_string_error_points_at_token(text, position, token, fragment):
    err = parse_error(text)
    assert (err.position, err.token) == (position, token)
    assert fragment in err.reason


def test_error_message_quotes_string_and_puts_caret_under_token():
    lines = str(parse_error("expandable_segments:True,max_split_size:128")).splitlines()
    assert lines[0].startswith(
        "invalid allocator config 'expandable_segments:True,max_split_size:128'")
    assert lines[1:] == ["    expandable_segments:True,max_split_size:128",
                         "                             ^"]


def test_caret_stays_aligned_when_string_has_tabs():
    lines = str(parse_error("expandable_segments:\tnope")).splitlines()
    assert lines[2].index("^") == lines[1].index("nope")


def test_config_error_is_a_value_error():
    assert isinstance(parse_error("bogus:1"), ValueError)


def test_config_error_survives_pickling():
    err = parse_error("bogus:1")
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.text, copy.position, copy.token, str(copy)) == (err.text, 0, "bogus", str(err))


# -- generic and CUDA configs ----------------------------------------------------------------------

def test_generic_config_parses_generic_keys():
    cfg = config.AllocatorConfig("max_split_size_mb:128,expandable_segments:True")
    assert (cfg.max_split_size, cfg.expandable_segments) == (128 * MiB, True)


def test_generic_config_names_cuda_config_for_cuda_only_key():
    err = parse_error("backend:native", config.AllocatorConfig)
    assert "handled by CudaAllocatorConfig" in err.reason


def test_subclass_can_register_its_own_key():
    class Extended(config.AllocatorConfig):
        _DEFAULTS = {**config.AllocatorConfig._DEFAULTS, "flavour": "plain"}

        @config._parses("flavour")
        def _parse_flavour(self, tok, i, key):
            self.flavour = tok.word(i, "a flavour")
            return i + 1

    assert Extended("flavour:spicy,expandable_segments:True").flavour == "spicy"


def test_registering_a_key_twice_is_rejected():
    with pytest.raises(TypeError, match="registered twice"):
        class Clash(Cuda):  # noqa: F841
            @config._parses("expandable_segments")
            def _parse_again(self, tok, i, key):
                return i + 1


# -- tokenizer -------------------------------------------------------------------------------------

def test_tokenizer_splits_separators_and_keeps_positions():
    tok = config.ConfigTokenizer("a:[1, b c]")
    assert [(tok[i], tok.position(i)) for i in range(len(tok))] == [
        ("a", 0), (":", 1), ("[", 2), ("1", 3), (",", 4), ("bc", 6), ("]", 9)]


def test_tokenizer_position_past_the_end_is_string_length():
    assert config.ConfigTokenizer("a:b ").position(3) == 4


@pytest.mark.parametrize("text, reader, expected", [
    ("0", "size", 0), ("007", "size", 7), (str(SIZE_MAX), "size", SIZE_MAX),
    ("0.5", "float", 0.5), ("-2", "float", -2.0), ("1e3", "float", 1000.0),
    ("True", "bool", True), ("False", "bool", False),
])
def test_tokenizer_reader_accepts(text, reader, expected):
    assert getattr(config.ConfigTokenizer(text), reader)(0, "x") == expected


@pytest.mark.parametrize("text, reader", [
    ("-1", "size"), ("1.5", "size"), ("abc", "size"), ("", "size"), ("True", "size"), ("１", "size"),
    (",", "size"), ("abc", "float"), ("", "float"), ("1_0", "float"), ("inf", "float"),
    ("true", "bool"), ("1", "bool"), ("", "bool"), (":", "bool"),
])
def test_tokenizer_reader_rejects(text, reader):
    with pytest.raises(ConfigError):
        getattr(config.ConfigTokenizer(text), reader)(0, "x")


def test_tokenizer_expect_diagnoses_missing_separator():
    with pytest.raises(ConfigError, match="expected ':'") as info:
        config.ConfigTokenizer("a b").expect(1, ":")
    assert info.value.position == 3


# -- environment and precedence --------------------------------------------------------------------

@pytest.mark.parametrize("present, winner", [
    (("PYALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"), "PYALLOC_CONF"),
    (("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"), "PYTORCH_CUDA_ALLOC_CONF"),
    (("PYTORCH_ALLOC_CONF",), "PYTORCH_ALLOC_CONF"),
])
def test_first_set_environment_variable_wins(present, winner):
    values = {"PYALLOC_CONF": "max_split_size_mb:100",
              "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:200",
              "PYTORCH_ALLOC_CONF": "max_split_size_mb:300"}
    cfg = config.config_from_environment({name: values[name] for name in present})
    assert cfg.last_settings_string == values[winner]


def test_environment_variables_are_not_merged():
    cfg = config.config_from_environment({"PYALLOC_CONF": "max_split_size_mb:128",
                                          "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert cfg.expandable_segments is False


def test_empty_environment_variable_still_wins():
    cfg = config.config_from_environment({"PYALLOC_CONF": "",
                                          "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert cfg.expandable_segments is False


def test_no_environment_variable_gives_defaults():
    assert config.config_from_environment({}) == Cuda()


def test_environment_error_names_the_variable():
    with pytest.raises(ConfigError, match="in PYTORCH_CUDA_ALLOC_CONF") as info:
        config.config_from_environment({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:yes"})
    assert info.value.source == "PYTORCH_CUDA_ALLOC_CONF"


def test_resolve_config_string_argument_beats_environment(monkeypatch):
    monkeypatch.setenv("PYALLOC_CONF", "expandable_segments:True")
    assert config.resolve_config("max_split_size_mb:128").expandable_segments is False


def test_resolve_config_none_reads_environment(monkeypatch):
    monkeypatch.setenv("PYALLOC_CONF", "expandable_segments:True")
    assert config.resolve_config(None).expandable_segments is True


def test_resolve_config_copies_a_config_object():
    given_cfg = Cuda("expandable_segments:True")
    resolved = config.resolve_config(given_cfg)
    assert resolved == given_cfg and resolved is not given_cfg


def test_resolve_config_rejects_other_types():
    with pytest.raises(TypeError):
        config.resolve_config(42)


# -- process-wide runtime settings -----------------------------------------------------------------

def test_current_settings_come_from_environment(process_settings, monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert config.current_settings().expandable_segments is True


def test_get_allocator_settings_returns_last_string(process_settings):
    config.set_allocator_settings("expandable_segments:True")
    config.set_allocator_settings("max_split_size_mb:128")
    assert config.get_allocator_settings() == "max_split_size_mb:128"


def test_set_allocator_settings_resets_like_pytorch(process_settings):
    config.set_allocator_settings("max_split_size_mb:128,expandable_segments:True")
    config.set_allocator_settings("garbage_collection_threshold:0.5")
    settings = config.current_settings()
    assert (settings.max_split_size, settings.expandable_segments) == (SIZE_MAX, True)


def test_set_allocator_settings_notifies_listeners(process_settings):
    seen = []
    recorder = _Recorder(seen)
    config.add_settings_listener(recorder.record)
    config.set_allocator_settings("expandable_segments:True")
    assert [s.expandable_segments for s in seen] == [True]


def test_listener_receives_a_copy_of_the_settings(process_settings):
    seen = []
    recorder = _Recorder(seen)
    config.add_settings_listener(recorder.record)
    config.set_allocator_settings("expandable_segments:True")
    assert seen[0] == config.current_settings() and seen[0] is not config.current_settings()


def test_failed_set_allocator_settings_notifies_no_one_and_changes_nothing(process_settings):
    seen = []
    recorder = _Recorder(seen)
    config.add_settings_listener(recorder.record)
    config.set_allocator_settings("expandable_segments:True")
    with pytest.raises(ConfigError):
        config.set_allocator_settings("expandable_segments:False,max_split_size_mb:1")
    assert len(seen) == 1 and config.current_settings().expandable_segments is True


def test_listener_is_held_weakly(process_settings):
    recorder = _Recorder([])
    config.add_settings_listener(recorder.record)
    alive = weakref.ref(recorder)
    del recorder
    gc.collect()
    config.set_allocator_settings("expandable_segments:True")
    assert alive() is None and config._listeners == []


def test_removed_listener_is_not_called(process_settings):
    seen = []
    recorder = _Recorder(seen)
    config.add_settings_listener(recorder.record)
    config.remove_settings_listener(recorder.record)
    config.set_allocator_settings("expandable_segments:True")
    assert seen == []


def test_failing_listener_does_not_stop_the_others(process_settings):
    seen = []
    failing, recorder = _Recorder(None), _Recorder(seen)
    config.add_settings_listener(failing.record)
    config.add_settings_listener(recorder.record)
    with pytest.raises(AttributeError):
        config.set_allocator_settings("expandable_segments:True")
    assert len(seen) == 1


class _Recorder:
    """Stands in for an allocator: registers a bound method, as CachingAllocator does."""

    def __init__(self, seen):
        self.seen = seen

    def record(self, settings):
        self.seen.append(settings)   # AttributeError when seen is None: a failing listener


# -- PyTorch's snapshot settings -------------------------------------------------------------------

def test_all_eight_traces_are_present():
    assert len(TRACE_FILES) == 8


@pytest.mark.parametrize("path", TRACE_FILES, ids=lambda p: p.name)
def test_snapshot_dict_equals_pytorchs_for_trace(path):
    with gzip.open(path) as f:
        expected = pickle.load(f)["allocator_settings"]
    got = Cuda(expected["PYTORCH_CUDA_ALLOC_CONF"]).to_snapshot_dict()
    assert got == expected
    assert [(k, type(v)) for k, v in got.items()] == [(k, type(v)) for k, v in expected.items()]


def test_every_conf_in_torch_peaks_parses():
    lines = (TRACES / "torch-peaks.jsonl").read_text().splitlines()
    confs = [json.loads(line)["conf"] for line in lines]
    assert confs and [Cuda(conf).last_settings_string for conf in confs] == confs


# -- properties ------------------------------------------------------------------------------------

FRAGMENTS = [",", ":", "[", "]", ">", " ", "\t", "True", "False", "true", "0", "1", "4", "20",
             "128", "256", "0.5", "-1", "1.5", "1e3", "native", "cudaMallocAsync", "x", "_mb",
             *Cuda._parsers]
config_strings = st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=config_strings)
def test_random_string_parses_or_raises_config_error_leaving_config_unchanged(text):
    cfg = non_default_config()
    try:
        cfg.parse(text)
    except ConfigError as err:
        assert cfg == non_default_config()
        assert 0 <= err.position <= len(text)
        assert (err.token == "") == (err.position == len(text))
        assert err.token[:1] == text[err.position:err.position + 1].strip()[:1]
    else:
        assert cfg.last_settings_string == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_arbitrary_text_parses_or_raises_config_error(text):
    try:
        Cuda(text)
    except ConfigError as err:
        assert err.text == text


@settings(max_examples=200, deadline=None)
@given(text=config_strings)
def test_parsing_the_same_string_twice_changes_nothing(text):
    try:
        cfg = Cuda(text)
    except ConfigError:
        return
    before = cfg.copy()
    cfg.parse(text)
    assert cfg == before
