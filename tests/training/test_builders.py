"""training/builders.py: the DataConfig reaches the dataset builder whole."""

from megadlms.config import DataConfig
from megadlms.data import ByteTokenizer
from megadlms.training.builders import build_datasets
from tests.data.test_blend_split import _doc_id_corpus


def test_every_per_split_path_reaches_its_split(tmp_path):
    # --test-data-path used to be dropped here: the run then had no test set and said nothing
    prefixes = [_doc_id_corpus(tmp_path, n, 6, base=b) for n, b in (("tr", 0), ("va", 1000), ("te", 2000))]
    data = DataConfig(
        train_data_path=prefixes[:1], valid_data_path=prefixes[1:2], test_data_path=prefixes[2:]
    )
    sets = build_datasets(
        data,
        ByteTokenizer(),
        seq_length=8,
        seed=1,
        train_samples=4,
        valid_samples=2,
        test_samples=2,
        with_test=True,
    )
    for ds, base in zip(sets, (0, 1000, 2000)):
        text = ds[0]["text"]
        assert ((text >= base) & (text < base + 6)).all()  # tokens of that split's corpus only
