"""The toy family's tensor-parallel plan, as data: the MLP split Megatron-style, the embedding on the
vocabulary, logits left sharded on the vocabulary for the loss."""

from dtlaunch.models.tp_styles import Colwise, Rowwise, VocabEmbedding


def model_plan(m, sequence_parallel):
    return {
        "tok_embeddings": VocabEmbedding(output="replicate"),
        "output": Colwise(output="shard(-1)", local_output=False),
    }


def block_plan(m, sequence_parallel):
    return {"up": Colwise(), "down": Rowwise()}
