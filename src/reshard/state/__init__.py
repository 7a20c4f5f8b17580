"""What a state dict is (layer 2): element types, sharded leaves and their boxes, tagged JSON values,
content fingerprints, flattening."""
