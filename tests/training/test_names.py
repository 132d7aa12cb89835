from training.names import closest, unknown


def test_closest_takes_initials_words_prefixes_and_typos():
    names = ["learning_rate", "kl_coef", "steps", "group_size"]
    assert closest("lr", names) == "learning_rate"
    assert closest("kl", names) == "kl_coef"
    assert closest("grp", names) is None
    assert closest("group", names) == "group_size"
    assert closest("setps", names) == "steps"
    assert closest("STEPS", names) == "steps"
    assert closest("banana", names) is None


def test_unknown_lists_a_short_list_of_valid_names_and_suggests_one():
    assert unknown("base model", "smollm", ["smollm2-135m", "tiny"]) == (
        "unknown base model 'smollm' (valid: smollm2-135m, tiny); did you mean smollm2-135m?"
    )
    assert unknown("base model", "x", []) == "unknown base model 'x'"
    many = [f"name_{i}" for i in range(20)]
    assert unknown("field", "name_1x", many, quoted=False) == "unknown field; did you mean name_1?"
