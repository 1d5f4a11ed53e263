"""The builders of one forward's layout (kdaserve/model/batch.py assembles them): the packed
rows every builder shares, KDA rows and conv windows, MLA pages and masks, snapshot plans."""
