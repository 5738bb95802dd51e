"""A job's tags and note in the JobSpec (trainyard/tags.py): the rules, table by table."""
import pytest

from trainyard.spec import SpecError, parse_job_spec
from trainyard.tags import MAX_NOTE_CHARS, MAX_TAGS, note_problem, split_tags, tags_problems


def test_tags_and_note_default_empty_and_are_stored():
    assert (parse_job_spec({"name": "x"}).tags, parse_job_spec({"name": "x"}).note) == ([], "")
    spec = parse_job_spec({"name": "x", "tags": ["lr-sweep", "v2.1", "a_b"], "note": "first try\n\tlr 3e-4"})
    assert spec.to_json()["tags"] == ["lr-sweep", "v2.1", "a_b"]
    assert spec.to_json()["note"] == "first try\n\tlr 3e-4"


@pytest.mark.parametrize("tags, message", [
    (["Upper"], "'Upper' is not a tag"),
    (["-lead"], "is not a tag"),
    (["has space"], "is not a tag"),
    (["x" * 41], "is not a tag: 1-40 characters"),
    ([""], "is not a tag"),
    (["ümlaut"], "is not a tag"),
    ([3], "a tag is a string"),
    ("one-string", "tags is a list of strings"),
    ([f"t{i}" for i in range(MAX_TAGS + 1)], f"at most {MAX_TAGS} tags"),
    (["a", "b", "a"], "each tag once: a repeated"),
])
def test_bad_tags_are_refused_at_the_field(tags, message):
    with pytest.raises(SpecError) as exc:
        parse_job_spec({"name": "x", "tags": tags})
    assert list(exc.value.errors) == ["tags"] and message in exc.value.errors["tags"][0], exc.value.errors


@pytest.mark.parametrize("note, message", [
    ("x" * (MAX_NOTE_CHARS + 1), f"at most {MAX_NOTE_CHARS} characters"),
    ("bell\x07", "control characters"),
    ("esc\x1b[31m", "control characters"),
    (["a list"], "the note is a string"),
])
def test_bad_notes_are_refused_at_the_field(note, message):
    with pytest.raises(SpecError) as exc:
        parse_job_spec({"name": "x", "note": note})
    assert list(exc.value.errors) == ["note"] and message in exc.value.errors["note"][0], exc.value.errors


def test_the_limits_themselves_are_accepted():
    tags = [f"t{i:02d}" + "x" * 37 for i in range(MAX_TAGS)]  # 16 tags of 40 characters
    assert tags_problems(tags) == [] and len(tags[0]) == 40
    assert note_problem("n" * MAX_NOTE_CHARS) is None
    assert parse_job_spec({"name": "x", "tags": tags, "note": "n" * MAX_NOTE_CHARS}).tags == tags


@pytest.mark.parametrize("text, tags", [
    ("", []), ("a", ["a"]), ("a, b  c,,d", ["a", "b", "c", "d"]), (" a a b ", ["a", "b"]), ("a\nb\tc", ["a", "b", "c"]),
])
def test_split_tags_reads_a_typed_box(text, tags):
    assert split_tags(text) == tags


def test_the_runtime_reads_a_spec_with_tags_and_note():
    from trainyard.spec import JobSpec

    stored = parse_job_spec({"name": "x", "tags": ["a"], "note": "n"}).to_json()
    assert JobSpec.model_validate(stored).tags == ["a"]
