"""The video track on clips made here with PyAV's encoders: containers and codecs, variable frame rates,
rotation, odd sizes and 10-bit streams decoded right; bad files skipped and named; augmentation the same
for every frame of a clip; the video networks; a whole run on the generated motion task (train, infer with
frame strips, ONNX export)."""

from __future__ import annotations

import dataclasses
import json
import logging
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose

from onn.errors import UserError
from onn.hardware.profile import resolve


def ramp(frames: int = 16, height: int = 64, width: int = 64) -> np.ndarray:
    """Frame i has a white band across 1/frames of the width at position i: a decoded frame says which it is."""
    out = np.zeros((frames, height, width, 3), np.uint8)
    band = width // frames
    for i in range(frames):
        out[i, :, i * band : (i + 1) * band] = 255
    return out


def which(clip: torch.Tensor, frames: int = 16) -> list[int]:
    """The ramp index of each decoded frame of a [C, T, H, W] clip (any width)."""
    columns = clip.float().mean(dim=(0, 2))  # [T, W]
    return [int(c.argmax()) * frames // clip.shape[-1] for c in columns]


@pytest.mark.parametrize(
    "codec, suffix, pix_fmt",
    [
        ("libx264", "mp4", "yuv420p"),
        ("mpeg4", "avi", "yuv420p"),
        ("libx264", "mov", "yuv420p"),
        ("libvpx-vp9", "webm", "yuv420p"),
        ("libx265", "mkv", "yuv420p10le"),
        ("libsvtav1", "mkv", "yuv420p"),
        ("libx264", "mp4", "yuv420p10le"),
    ],
)
def test_containers_codecs_and_10_bit_decode_to_evenly_sampled_frames(tmp_path, codec, suffix, pix_fmt):
    """h264/h265/vp9/av1/mpeg4 in mp4/mov/avi/mkv/webm, 8 and 10 bit: 8 of 16 frames, evenly spaced, resized."""
    from onn.modalities.video.builtin import write_clip
    from onn.modalities.video.decode import Fit, load

    path = tmp_path / f"clip.{suffix}"
    options = {"options": {"x265-params": "log-level=error"}} if codec == "libx265" else {}
    write_clip(path, ramp(), 8, codec, pix_fmt, **options)  # x265 and SVT-AV1 need frames of 64 px or more
    clip, seconds = load(str(path), Fit(frames=8, channels=3, size=(32, 48), resize="resize"))
    assert clip.shape == (3, 8, 32, 48) and clip.dtype == torch.uint8
    assert seconds == pytest.approx(2.0, abs=0.01)
    assert which(clip) == [
        0,
        2,
        4,
        6,
        8,
        10,
        12,
        15,
    ]  # the frame shown at each of 8 evenly spaced times, first and last included


def test_variable_frame_rate_rotation_and_odd_sizes(tmp_path):
    import av

    from onn.modalities.video.builtin import write_clip
    from onn.modalities.video.decode import Fit, load

    path = tmp_path / "vfr.mkv"  # 16 frames at irregular times (ms): sampling goes by time, not by index
    times = [0, 40, 80, 200, 210, 220, 500, 533, 566, 600, 1000, 1010, 1300, 1310, 1320, 1500]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width = stream.height = 64
        stream.pix_fmt, stream.time_base = "yuv420p", Fraction(1, 1000)
        stream.codec_context.time_base = Fraction(1, 1000)  # else the encoder rounds times to its 1/25 s
        for array, t in zip(ramp(), times):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            frame.pts, frame.time_base = t, Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    clip, _ = load(str(path), Fit(8, 3, (32, 32), "resize"))
    targets = np.linspace(0, 1500, 8)  # the frame shown at each of 8 evenly spaced times
    assert (
        which(clip)
        == [int(np.searchsorted(times, t, side="right") - 1) for t in targets]
        == [0, 4, 5, 9, 9, 11, 11, 15]
    )

    path = tmp_path / "portrait.mp4"  # stored 96x64 (W x H) with a 90-degree display rotation, as phones write
    image = np.zeros((64, 96, 3), np.uint8)
    image[:16, :16] = 255  # a white corner, top left as stored
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        stream.set_display_rotation(90)
        for _ in range(4):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    clip, _ = load(str(path), Fit(2, 1, (48, 32), "resize"))  # shown upright: 64 wide, 96 tall, here halved
    upright = np.rot90(image[::2, ::2, 0], 1)
    assert clip.shape == (1, 2, 48, 32)
    assert (clip[0, 0].numpy() > 128).nonzero()[0].mean() == pytest.approx((upright > 128).nonzero()[0].mean(), abs=1)

    path = tmp_path / "odd.avi"  # 33x17 pixels, centre-cropped to a square
    write_clip(path, np.random.default_rng(0).integers(0, 255, (5, 17, 33, 3), dtype=np.uint8), 5, "mpeg4")
    clip, _ = load(str(path), Fit(4, 3, (16, 16), "center_crop"))
    assert clip.shape == (3, 4, 16, 16)


def test_bad_videos_are_skipped_counted_and_named(tmp_path, caplog):
    """Corrupt, truncated, zero-length and stream-less files fail one at a time; unknown extensions are named."""
    import soundfile as sf

    from onn.modalities.video.builtin import moving_square, write_clip
    from onn.modalities.video.dataset import READER
    from onn.modalities.video.decode import BadFile, Fit, load

    rng = np.random.default_rng(0)
    for label in ("left", "right"):
        (tmp_path / "clips" / label).mkdir(parents=True)
        for i in range(6):
            write_clip(tmp_path / "clips" / label / f"{i}.mp4", moving_square(rng, label, 6, 24), 6)
    folder = tmp_path / "clips" / "left"
    good = (folder / "0.mp4").read_bytes()
    (folder / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 8)
    (folder / "truncated.mp4").write_bytes(good[:400])
    (folder / "empty.mkv").write_bytes(b"")
    sf.write(folder / "sound.mkv", np.zeros(800, np.float32), 8000, format="WAV")  # audio only, named as a video
    (folder / "notes.xyz").write_bytes(good)
    fit = Fit(4, 3, (16, 16), "resize")
    for name, why in (
        ("corrupt.mp4", "not a decodable video"),
        ("truncated.mp4", "not a decodable video"),
        ("empty.mkv", "empty file"),
        ("sound.mkv", "no video stream"),
    ):
        with pytest.raises(BadFile, match=why):
            load(str(folder / name), fit)
    cfg = compose("data=video").data
    with pytest.raises(UserError, match=r"4 of 16 video files could not be decoded \(first: left/corrupt.mp4"):
        READER.read(str(tmp_path / "clips"), cfg, fit)
    with caplog.at_level(logging.WARNING, logger="onn"):
        decoded, _ = READER.read(str(tmp_path / "clips"), dataclasses.replace(cfg, max_bad_fraction=0.3), fit)
    assert len(decoded["all"].labels) == 12 and len(decoded["all"].skipped) == 4
    assert "left/sound.mkv: no video stream" in caplog.text and "left/notes.xyz" in caplog.text


def test_settings_that_make_no_sense_name_their_key():
    from onn.modalities import get

    video = get("video")
    for override, key in (
        ("data.frames=0", "data.frames"),
        ("data.decode_frames=2", "data.decode_frames"),
        ("data.image_size=[4,4]", "data.image_size"),
        ("data.sampling=sometimes", "data.sampling"),
        ("data.resize=squash", "data.resize"),
        ("model=audio_cnn", "does not take clips"),
    ):
        with pytest.raises(UserError, match=key):
            video.check(compose("data=video", "model=video_c3d_tiny", override))


def test_augmentation_is_the_same_for_every_frame_of_a_clip():
    from onn.config.data import ColorJitter, ImageAugment, RandomErasing
    from onn.modalities.video.transform import ClipTransform

    augment = ImageAugment(
        crop_padding=4,
        hflip=0.5,
        color_jitter=ColorJitter(brightness=0.3, contrast=0.3, saturation=0.3),
        random_erasing=RandomErasing(p=1.0),
    )
    transform = ClipTransform(augment, [0.5] * 3, [0.25] * 3, frames=4, sampling="random")
    frame = torch.randint(0, 256, (8, 3, 1, 16, 16), dtype=torch.uint8)
    clips = frame.expand(8, 3, 12, 16, 16).contiguous()  # every frame of a clip the same picture
    torch.manual_seed(0)
    out = transform(clips, train=True)
    assert out.shape == (8, 3, 4, 16, 16)
    assert torch.equal(out, out[:, :, :1].expand_as(out))  # same crop, flip, jitter and erased box on every frame
    assert not torch.allclose(out[0], out[1])  # but each clip its own
    plain = transform(clips, train=False)
    assert not torch.allclose(out, plain) and torch.equal(plain, transform(clips, train=False))
    counted = torch.arange(12, dtype=torch.uint8).view(1, 1, 12, 1, 1).expand(2, 1, 12, 2, 2).contiguous()
    picks = ClipTransform(None, [0.0], [1 / 255], frames=4, sampling="random")
    assert picks(counted, train=False)[0, 0, :, 0, 0].round().tolist() == [0, 4, 7, 11]  # evenly spaced
    torch.manual_seed(1)
    drawn = picks(counted, train=True)[:, 0, :, 0, 0].round()
    assert all(0 <= v[0] <= 2 < v[1] <= 5 < v[2] <= 8 < v[3] <= 11 for v in drawn.tolist())  # one from each segment


@pytest.mark.parametrize(
    "model", ["video_r3d_18", "video_r2plus1d", "video_mc3_18", "video_frames_resnet18", "video_c3d_tiny"]
)
def test_video_networks_plan_on_the_meta_device(model):
    from onn.modalities import get

    cfg = compose(f"model={model}", "data=video", "data.source=/nowhere", "hardware=rtx3060_12gb", "data.num_classes=5")
    plan, spec = get("video").plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))
    assert plan.strategy == "full" and spec.kind == "network" and spec.sample_flops > 0 and spec.params > 0
    assert plan.candidates["full"]["fits"]


def test_a_clip_small_enough_to_reach_one_value_per_channel_plans():
    """A 16 px clip reaches r3d_18's last BatchNorm as [1, 512, 1, 1, 1]: the plan's batch of one raised torch's
    "Expected more than 1 value per channel when training" with a traceback, where a batch of 2 or more trains."""
    from onn.modalities import get

    cfg = compose("model=video_r3d_18", "recipe=video_motion", "data.image_size=[16,16]", "hardware=cpu_16gb")
    plan, spec = get("video").plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))
    assert spec.sample_activation_bytes > 0 and spec.sample_flops > 0 and plan.strategy == "full"


def test_a_one_frame_clip_lasts_a_frame(tmp_path):
    """A clip of one frame counted 0 s (the step between its timestamps, of which it has one): the media/decode
    figures of task=bench_media divide by the seconds decoded."""
    from onn.modalities.video.builtin import write_clip
    from onn.modalities.video.decode import Fit, load

    write_clip(tmp_path / "one.mp4", ramp(1, 32, 32), 8, "libx264")
    clip, seconds = load(str(tmp_path / "one.mp4"), Fit(frames=4, channels=3, size=(16, 16), resize="resize"))
    assert clip.shape == (3, 4, 16, 16) and seconds == pytest.approx(1 / 8, abs=1e-3)


def test_a_3d_network_on_a_bf16_cpu_plans_float32_and_says_why():
    """On a CPU with bf16 matrix units the plan picked bf16-mixed for every network, and oneDNN's bf16 Conv3d
    backward then corrupted the heap at 112 px (PyTorch 2.11): a 3-D network keeps 32-true there, and a
    bf16-mixed the user gives stays, with a warning."""
    from onn.modalities import get

    bf16_cpu = ("hardware=cpu_16gb", "hardware.bf16=true", "data.source=/nowhere", "data.num_classes=5")
    cfg = compose("model=video_c3d_tiny", "data=video", *bf16_cpu)
    plan, spec = get("video").plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))
    assert spec.conv3d and plan.precision == "32-true"
    assert any(r.startswith("precision 32-true") and "3-D convolutions" in r for r in plan.reasons), plan.reasons
    frames = compose("model=video_frames_resnet18", "data=video", *bf16_cpu)  # 2-D convolutions: bf16 still pays
    assert get("video").plan(frames, resolve(frames.hardware, "/tmp", "/tmp"))[0].precision == "bf16-mixed"
    given = compose("model=video_c3d_tiny", "data=video", "strategy.precision=bf16-mixed", *bf16_cpu)
    plan, _ = get("video").plan(given, resolve(given.hardware, "/tmp", "/tmp"))
    assert plan.precision == "bf16-mixed" and any(r.startswith("WARNING") and "Conv3d" in r for r in plan.reasons)


@pytest.mark.slow
def test_video_networks_train_a_step_on_clips():
    from onn.config.model import NetworkConfig
    from onn.models.video import build_video_classifier

    clips = torch.randn(2, 1, 4, 32, 32)
    for source, extra in (
        ("torchvision:mc3_18", {}),
        ("timm:resnet18", {"temporal_pool": "tconv"}),
        ("zoo:c3d_tiny", {}),
    ):
        model = build_video_classifier(NetworkConfig(name=source, source=source, **extra), 1, 3, 4, [32, 32])
        loss = torch.nn.functional.cross_entropy(model(clips), torch.tensor([0, 2]))
        loss.backward()
        assert model(clips).shape == (2, 3) and all(
            p.grad is not None for p in model.parameters() if p.requires_grad
        ), source


@pytest.mark.modalities
@pytest.mark.slow
def test_motion_run_trains_infers_and_exports(tmp_path):
    """builtin:motion, made small: clips encoded and decoded, the 3-D CNN trained, strips of frames, ONNX."""
    from onn.app import execute

    common = [
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
    ]
    cfg = compose(
        "recipe=video_motion",
        *common,
        "data.motion.train_per_class=10",
        "data.motion.test_per_class=4",
        "data.motion.size=24",
        "data.image_size=[16,16]",
        "data.batch_size=8",
        "trainer.max_epochs=4",
        "+model.kwargs.widths=[8,16]",
        "export=onnx",
    )
    metrics = execute(cfg, tmp_path / "train")
    assert metrics["modality"] == "video" and metrics["resident"] is True
    assert metrics["train/loss_final"] < metrics["train/loss_initial"] and metrics["export/max_abs_diff"] < 1e-3
    import onnx

    dims = [d.dim_value for d in onnx.load(metrics["export/onnx"]).graph.input[0].type.tensor_type.shape.dim]
    assert dims[1:] == [3, 12, 16, 16]  # the clip as stored (12 frames): the graph samples the network's 8 itself
    clips = sorted((tmp_path / "cache" / "builtin").glob("motion-*/test"))[0]
    ckpt = tmp_path / "train" / "checkpoints" / "last.ckpt"
    out = execute(compose(*common, "task=infer", f"ckpt={ckpt}", f"task.input={clips}"), tmp_path / "infer")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert len(rows) == 16 and {r["true"] for r in rows} == {"down", "left", "right", "up"}
    from PIL import Image

    assert Image.open(out["infer/picture"]).size[0] >= 8 * 16  # 8 frames side by side per clip


@pytest.mark.parametrize("codec, container", [("libx264", "mp4"), ("libvpx-vp9", "webm"), ("mpeg4", "ts")])
def test_a_long_clip_is_sampled_by_seeking_to_keyframes_not_by_decoding_every_frame(
    tmp_path, monkeypatch, codec, container
):
    """16 frames of 240 with a keyframe every 12: the frames decoded are those of the groups of pictures that hold
    the chosen ones, and the clip is the one decoding every frame gives."""
    from onn.modalities.video import decode

    frames = np.zeros((240, 32, 32, 3), np.uint8)
    frames[:, :, :, 0] = np.arange(240)[:, None, None]  # each frame's red level says which it is
    path = tmp_path / f"long.{container}"
    from onn.modalities.video.builtin import write_clip

    write_clip(path, frames, 24, codec, gop_size=12)
    seen, original = [], decode.decoded_frames

    def counted(container, stream):
        for frame in original(container, stream):
            seen.append(frame.pts)
            yield frame

    fit = decode.Fit(16, 3, (32, 32), "resize")
    everything, _ = decode._decode_all(str(path), fit)
    monkeypatch.setattr(decode, "decoded_frames", counted)
    monkeypatch.setattr(decode, "_decode_all", None)  # no falling back to decoding every frame unseen
    clip, duration = decode.decode_video(str(path), fit)
    assert torch.equal(clip, torch.from_numpy(np.stack(everything).transpose(3, 0, 1, 2).copy()))
    assert abs(duration - 10.0) < 1e-2  # webm keeps milliseconds
    assert 16 <= len(seen) <= 16 * 12, len(seen)  # at most each chosen frame's group of pictures up to it, of 240


def test_data_auto_finds_audio_and_video_folders(tmp_path):
    import soundfile as sf

    from onn.modalities import detect
    from onn.modalities.video.builtin import write_clip

    (tmp_path / "sounds" / "a").mkdir(parents=True)
    sf.write(tmp_path / "sounds" / "a" / "1.flac", np.zeros(800, np.float32), 8000)
    (tmp_path / "sounds" / "README.md").write_text("notes")
    (tmp_path / "clips" / "a").mkdir(parents=True)
    write_clip(tmp_path / "clips" / "a" / "1.webm", ramp(2, 16, 16), 2, "libvpx-vp9")
    assert detect(tmp_path / "sounds")[0].name == "audio"
    assert detect(tmp_path / "clips")[0].name == "video"
    assert detect(tmp_path / "clips" / "a" / "1.webm")[0].name == "video"


def test_data_auto_tells_mpeg_transport_streams_from_typescript(tmp_path):
    """.ts is both an MPEG transport stream and a TypeScript source file: a folder of TypeScript was sniffed as
    video by its suffix (and failed to decode); the packets' sync bytes now decide, and a transport stream is video."""
    from onn.modalities import detect
    from onn.modalities.video.builtin import write_clip

    (tmp_path / "clips" / "a").mkdir(parents=True)
    write_clip(tmp_path / "clips" / "a" / "1.ts", ramp(2, 16, 16), 2, "mpeg4")
    assert detect(tmp_path / "clips")[0].name == "video"
    assert detect(tmp_path / "clips" / "a" / "1.ts")[0].name == "video"
    cut = tmp_path / "cut" / "a" / "1.ts"  # a capture cut at an arbitrary byte: its first packet is a partial one
    cut.parent.mkdir(parents=True)
    cut.write_bytes((tmp_path / "clips" / "a" / "1.ts").read_bytes()[100:])
    assert detect(tmp_path / "cut")[0].name == "video"
    (tmp_path / "web" / "src").mkdir(parents=True)
    for name in ("app", "index", "util"):
        (tmp_path / "web" / "src" / f"{name}.ts").write_text(
            f"export const {name} = (x: number): number => x + 1;\n" * 20
        )
    with pytest.raises(UserError, match="no modality recognises what it holds"):
        detect(tmp_path / "web")
    assert detect(tmp_path / "web" / "src" / "app.ts")[0].name == "text"  # one file of text, as a .txt is


def test_data_auto_finds_audio_and_video_in_archives(tmp_path):
    """A .zip or .tar (compressed too) of class folders of sounds or clips, which data=audio and data=video read,
    was "no modality recognises what it holds" for data=auto."""
    import shutil
    import tarfile

    import soundfile as sf

    from onn.modalities import detect
    from onn.modalities.video.builtin import write_clip

    for name in ("low", "high"):
        (tmp_path / "sounds" / name).mkdir(parents=True)
        (tmp_path / "clips" / name).mkdir(parents=True)
        for i in range(3):
            sf.write(tmp_path / "sounds" / name / f"{i}.wav", np.zeros(800, np.float32), 8000)
            write_clip(tmp_path / "clips" / name / f"{i}.mp4", ramp(2, 16, 16), 2, "libx264")
    (tmp_path / "sounds" / "README.md").write_text("notes")
    for kind, folder in (("audio", "sounds"), ("video", "clips")):
        packed = [shutil.make_archive(str(tmp_path / f"{folder}_{f}"), f, tmp_path, folder) for f in ("zip", "tar")]
        with tarfile.open(tmp_path / f"{folder}.tar.gz", "w:gz") as tar:
            tar.add(tmp_path / folder, folder)
        for archive in (*packed, tmp_path / f"{folder}.tar.gz"):
            modality, reason = detect(Path(archive))
            assert modality.name == kind and reason.startswith(f"an archive of {kind} files (6 of"), (archive, reason)
