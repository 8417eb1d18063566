//! The few protobuf messages of TensorBoard's event files, encoded by hand: `Event`, `Summary`
//! (scalar, text and HParams-plugin values), `TensorProto` for a string scalar, and the HParams
//! plugin's session start/end info. Field numbers follow tensorflow/core/util/event.proto,
//! summary.proto, tensor.proto and tensorboard/plugins/hparams/plugin_data.proto.

/// A protobuf message under construction.
#[derive(Default)]
pub struct Msg(pub Vec<u8>);

fn varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

impl Msg {
    fn key(&mut self, field: u32, wire: u8) {
        varint(&mut self.0, (u64::from(field) << 3) | u64::from(wire));
    }
    pub fn varint(mut self, field: u32, v: u64) -> Self {
        self.key(field, 0);
        varint(&mut self.0, v);
        self
    }
    pub fn double(mut self, field: u32, v: f64) -> Self {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn float(mut self, field: u32, v: f32) -> Self {
        self.key(field, 5);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(mut self, field: u32, v: &[u8]) -> Self {
        self.key(field, 2);
        varint(&mut self.0, v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }
    pub fn str(self, field: u32, v: &str) -> Self {
        self.bytes(field, v.as_bytes())
    }
    pub fn msg(self, field: u32, m: Msg) -> Self {
        self.bytes(field, &m.0)
    }
}

/// `Event { wall_time = 1, step = 2, file_version = 3 | summary = 5 }`.
pub fn event(wall_time: f64, step: u64, body: EventBody) -> Vec<u8> {
    let m = Msg::default().double(1, wall_time).varint(2, step);
    match body {
        EventBody::FileVersion => m.str(3, "brain.Event:2").0,
        EventBody::Summary(values) => {
            let summary = values.into_iter().fold(Msg::default(), |s, v| s.msg(1, v));
            m.msg(5, summary).0
        }
    }
}

pub enum EventBody {
    FileVersion,
    Summary(Vec<Msg>),
}

/// `Summary.Value { tag = 1, simple_value = 2 }`.
pub fn scalar(tag: &str, v: f32) -> Msg {
    Msg::default().str(1, tag).float(2, v)
}

/// `SummaryMetadata { plugin_data = 1 { plugin_name = 1, content = 2 } }`.
fn plugin_metadata(plugin: &str, content: &[u8]) -> Msg {
    Msg::default().msg(1, Msg::default().str(1, plugin).bytes(2, content))
}

/// A text-plugin value: a scalar DT_STRING tensor (`dtype = 1` (7), `tensor_shape = 2`,
/// `string_val = 8`) with the `text` plugin's metadata (`metadata = 9`, `tensor = 8`).
pub fn text(tag: &str, markdown: &str) -> Msg {
    let tensor = Msg::default()
        .varint(1, 7)
        .msg(2, Msg::default())
        .bytes(8, markdown.as_bytes());
    Msg::default()
        .str(1, tag)
        .msg(9, plugin_metadata("text", &[]))
        .msg(8, tensor)
}

/// One hyperparameter value (`google.protobuf.Value`: number_value = 2, string_value = 3,
/// bool_value = 4).
#[derive(Clone, Debug, PartialEq)]
pub enum HParam {
    Number(f64),
    Text(String),
    Bool(bool),
}

const SESSION_START_TAG: &str = "_hparams_/session_start_info";
const SESSION_END_TAG: &str = "_hparams_/session_end_info";

fn hparams_value(tag: &str, data_field: u32, data: Msg) -> Msg {
    // HParamsPluginData { version = 1 (0), session_start_info = 3 | session_end_info = 4 }
    let content = Msg::default().varint(1, 0).msg(data_field, data);
    Msg::default()
        .str(1, tag)
        .msg(9, plugin_metadata("hparams", &content.0))
}

/// `SessionStartInfo { hparams = 1 (map<string, Value>), group_name = 4, start_time_secs = 5 }`.
pub fn session_start(hparams: &[(String, HParam)], group: &str, start_secs: f64) -> Msg {
    let mut info = Msg::default();
    for (k, v) in hparams {
        let value = match v {
            HParam::Number(x) => Msg::default().double(2, *x),
            HParam::Text(s) => Msg::default().str(3, s),
            HParam::Bool(b) => Msg::default().varint(4, u64::from(*b)),
        };
        info = info.msg(1, Msg::default().str(1, k).msg(2, value));
    }
    let info = info.str(4, group).double(5, start_secs);
    hparams_value(SESSION_START_TAG, 3, info)
}

/// Status of a finished session (hparams `Status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionStatus {
    Success = 1,
    Failure = 2,
}

/// `SessionEndInfo { status = 1, end_time_secs = 2 }`.
pub fn session_end(status: SessionStatus, end_secs: f64) -> Msg {
    let info = Msg::default().varint(1, status as u64).double(2, end_secs);
    hparams_value(SESSION_END_TAG, 4, info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_keys_follow_the_wire_format() {
        // field 2, varint 300 -> 0x10 0xac 0x02 (the protobuf guide's example)
        assert_eq!(Msg::default().varint(2, 300).0, vec![0x10, 0xac, 0x02]);
        // field 1, string "ab" -> 0x0a 0x02 'a' 'b'
        assert_eq!(Msg::default().str(1, "ab").0, vec![0x0a, 2, b'a', b'b']);
        // field 2, float 1.0 -> 0x15 then little-endian bits
        assert_eq!(
            Msg::default().float(2, 1.0).0,
            vec![0x15, 0x00, 0x00, 0x80, 0x3f]
        );
    }
}
