"""Images and video for M3, on the host: decoding, the dynamic-resolution resize, patches and the prompt's
placeholder runs, as transformers' MiniMaxM3VLProcessor makes them (docs/vision.md).

    media.py      bytes / Pillow images / arrays -> RGB arrays; the limits (corrupt, oversized -> ValueError)
    image.py      smart_resize, resize, normalise, patchify: an image -> ProcessedImage
    video.py      frames -> ProcessedVideo (temporal patches, segments of <= 4, timestamps)
    processor.py  MultiModalProcessor: prompt markers -> placeholder runs, token ids, the tower's inputs
"""
