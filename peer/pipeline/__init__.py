"""The pipeline axis of one peer: the forward/backward servicer of its stage and, on stage 0, the data driver."""
