def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """HiCache's `direct` I/O backend (layer-first): index copies per layer, in torch."""
    for src, dst in zip(src_layers, dst_layers, strict=False):
        rows = src.index_select(0, src_indices.to(src.device))
        dst.index_copy_(0, dst_indices.to(dst.device), rows.to(dst.device))
