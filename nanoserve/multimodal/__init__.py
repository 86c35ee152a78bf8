"""Images and video for M3, on the host: decoding, the dynamic-resolution resize, patches and the prompt's
placeholder runs, as transformers' MiniMaxM3VLProcessor makes them (docs/vision.md).

    media.py      bytes / Pillow images / arrays -> RGB arrays; the limits (corrupt, oversized -> ValueError)
    image.py      smart_resize, resize, normalise, patchify: an image -> ProcessedImage
    video.py      frames -> ProcessedVideo (temporal patches, segments of <= 4, timestamps)
    processor.py  MultiModalProcessor: prompt markers -> placeholder runs, token ids, the tower's inputs
    features.py   a processed prompt's items as the engine takes them (MultiModalFeature: content hash, runs)
    loader.py     where an image or video part comes from (data URLs, allowed hosts and paths) -> the processor
"""
