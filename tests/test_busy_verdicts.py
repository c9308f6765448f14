

@pytest.mark.slow
def test_preflight_triage_beside_a_hog_is_right_or_inconclusive(hog):
    """Beside other learners' runs: the unit's verdicts, or the inconclusive line; never a wrong verdict."""
    r = preflight.run(only=["triage"], progress=False)[0]
    assert r.status in ("passed", "inconclusive"), r.detail
    if r.status == "inconclusive":
        assert r.detail.startswith("inconclusive: machine busy (load ")
