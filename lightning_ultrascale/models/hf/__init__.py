"""Hugging Face models: translation of configs and weights both ways (``convert``), one weight reader
(``weights``) and the adapter that trains a ``transformers`` model as it is (``adapter``)."""
