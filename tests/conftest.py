import pytest


@pytest.fixture(scope="session")
def sample_target():
    """The sample target's Hugging Face directory (SmolLM2-135M-Instruct), converted once per cache."""
    from eagle_export.sample import sample_target_dir

    return sample_target_dir()
