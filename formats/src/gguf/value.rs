//! GGUF metadata values: the thirteen on-disk types, typed arrays, and accessors.

use std::fmt;

/// A metadata value type as GGUF stores it (the `u32` before every value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgufType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufType {
    pub fn from_id(id: u32) -> Option<GgufType> {
        Some(match id {
            0 => GgufType::U8,
            1 => GgufType::I8,
            2 => GgufType::U16,
            3 => GgufType::I16,
            4 => GgufType::U32,
            5 => GgufType::I32,
            6 => GgufType::F32,
            7 => GgufType::Bool,
            8 => GgufType::String,
            9 => GgufType::Array,
            10 => GgufType::U64,
            11 => GgufType::I64,
            12 => GgufType::F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// The fewest bytes one value of this type occupies on disk. Used to bound element
    /// counts by the bytes left in the file before anything is allocated.
    pub fn min_encoded_len(self) -> usize {
        match self {
            GgufType::U8 | GgufType::I8 | GgufType::Bool => 1,
            GgufType::U16 | GgufType::I16 => 2,
            GgufType::U32 | GgufType::I32 | GgufType::F32 => 4,
            GgufType::U64 | GgufType::I64 | GgufType::F64 => 8,
            // u64 length (+ bytes).
            GgufType::String => 8,
            // u32 element type + u64 count (+ items).
            GgufType::Array => 12,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgufType::U8 => "u8",
            GgufType::I8 => "i8",
            GgufType::U16 => "u16",
            GgufType::I16 => "i16",
            GgufType::U32 => "u32",
            GgufType::I32 => "i32",
            GgufType::F32 => "f32",
            GgufType::Bool => "bool",
            GgufType::String => "string",
            GgufType::Array => "array",
            GgufType::U64 => "u64",
            GgufType::I64 => "i64",
            GgufType::F64 => "f64",
        }
    }
}

impl fmt::Display for GgufType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A homogeneous GGUF array, kept typed (a 150k-entry vocabulary stays one `Vec<String>`,
/// a score table one `Vec<f32>`). Items of an array of arrays each carry their own type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufArray {
    /// The element type.
    pub fn elem_type(&self) -> GgufType {
        match self {
            GgufArray::U8(_) => GgufType::U8,
            GgufArray::I8(_) => GgufType::I8,
            GgufArray::U16(_) => GgufType::U16,
            GgufArray::I16(_) => GgufType::I16,
            GgufArray::U32(_) => GgufType::U32,
            GgufArray::I32(_) => GgufType::I32,
            GgufArray::F32(_) => GgufType::F32,
            GgufArray::Bool(_) => GgufType::Bool,
            GgufArray::String(_) => GgufType::String,
            GgufArray::Array(_) => GgufType::Array,
            GgufArray::U64(_) => GgufType::U64,
            GgufArray::I64(_) => GgufType::I64,
            GgufArray::F64(_) => GgufType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            GgufArray::String(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_f32s(&self) -> Option<&[f32]> {
        match self {
            GgufArray::F32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_i32s(&self) -> Option<&[i32]> {
        match self {
            GgufArray::I32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_u32s(&self) -> Option<&[u32]> {
        match self {
            GgufArray::U32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_u8s(&self) -> Option<&[u8]> {
        match self {
            GgufArray::U8(v) => Some(v),
            _ => None,
        }
    }

    /// Every element as an `i64`, for integer arrays of any width (token type tables are
    /// `i32` in llama.cpp's files but other writers differ). `None` for non-integer arrays
    /// or a `u64` element above `i64::MAX`.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        Some(match self {
            GgufArray::U8(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::I8(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::U16(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::I16(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::U32(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::I32(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::I64(v) => v.clone(),
            GgufArray::U64(v) => v
                .iter()
                .map(|&x| i64::try_from(x).ok())
                .collect::<Option<_>>()?,
            _ => return None,
        })
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufType {
        match self {
            GgufValue::U8(_) => GgufType::U8,
            GgufValue::I8(_) => GgufType::I8,
            GgufValue::U16(_) => GgufType::U16,
            GgufValue::I16(_) => GgufType::I16,
            GgufValue::U32(_) => GgufType::U32,
            GgufValue::I32(_) => GgufType::I32,
            GgufValue::F32(_) => GgufType::F32,
            GgufValue::Bool(_) => GgufType::Bool,
            GgufValue::String(_) => GgufType::String,
            GgufValue::Array(_) => GgufType::Array,
            GgufValue::U64(_) => GgufType::U64,
            GgufValue::I64(_) => GgufType::I64,
            GgufValue::F64(_) => GgufType::F64,
        }
    }

    /// Any integer type holding a non-negative value. Writers disagree on integer widths
    /// (`u32` from llama.cpp's converter, `u64` or `i32` elsewhere), so readers of counts
    /// and ids should not insist on one.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type whose value fits an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// [`GgufValue::as_u64`] as a `usize`.
    pub fn as_usize(&self) -> Option<usize> {
        self.as_u64().and_then(|v| usize::try_from(v).ok())
    }

    /// Any float or integer type as an `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self
                .as_i64()
                .map(|v| v as f64)
                .or_else(|| self.as_u64().map(|v| v as f64)),
        }
    }

    /// Any float or integer type as an `f32` (precision may be lost from `f64`).
    pub fn as_f32(&self) -> Option<f32> {
        self.as_f64().map(|v| v as f32)
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn as_string_array(&self) -> Option<&[String]> {
        self.as_array()?.as_strings()
    }

    pub fn as_f32_array(&self) -> Option<&[f32]> {
        self.as_array()?.as_f32s()
    }

    pub fn as_i32_array(&self) -> Option<&[i32]> {
        self.as_array()?.as_i32s()
    }

    pub fn as_u32_array(&self) -> Option<&[u32]> {
        self.as_array()?.as_u32s()
    }
}

macro_rules! from_scalar {
    ($($t:ty => $v:ident),* $(,)?) => {$(
        impl From<$t> for GgufValue {
            fn from(x: $t) -> Self { GgufValue::$v(x) }
        }
        impl From<Vec<$t>> for GgufArray {
            fn from(x: Vec<$t>) -> Self { GgufArray::$v(x) }
        }
        impl From<Vec<$t>> for GgufValue {
            fn from(x: Vec<$t>) -> Self { GgufValue::Array(GgufArray::$v(x)) }
        }
    )*};
}
from_scalar!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32, bool => Bool,
    String => String, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for GgufValue {
    fn from(s: &str) -> Self {
        GgufValue::String(s.to_string())
    }
}

impl From<GgufArray> for GgufValue {
    fn from(a: GgufArray) -> Self {
        GgufValue::Array(a)
    }
}

impl From<Vec<&str>> for GgufValue {
    fn from(v: Vec<&str>) -> Self {
        GgufValue::Array(GgufArray::String(
            v.into_iter().map(str::to_string).collect(),
        ))
    }
}

/// Short human form: scalars in full, strings quoted and cut at 60 characters, arrays as
/// their type, length and first few items (what `kiln inspect` prints).
impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::U8(v) => write!(f, "{v}"),
            GgufValue::I8(v) => write!(f, "{v}"),
            GgufValue::U16(v) => write!(f, "{v}"),
            GgufValue::I16(v) => write!(f, "{v}"),
            GgufValue::U32(v) => write!(f, "{v}"),
            GgufValue::I32(v) => write!(f, "{v}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::String(s) => write_short_str(f, s),
            GgufValue::Array(a) => write!(f, "{a}"),
            GgufValue::U64(v) => write!(f, "{v}"),
            GgufValue::I64(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
        }
    }
}

fn write_short_str(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    const MAX: usize = 60;
    if s.chars().count() > MAX {
        let cut: String = s.chars().take(MAX).collect();
        write!(f, "{:?}…", cut)
    } else {
        write!(f, "{s:?}")
    }
}

impl fmt::Display for GgufArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 5;
        write!(f, "[{}; {}]", self.elem_type(), self.len())?;
        if self.is_empty() {
            return Ok(());
        }
        f.write_str(" [")?;
        let n = self.len().min(SHOWN);
        for i in 0..n {
            if i > 0 {
                f.write_str(", ")?;
            }
            match self {
                GgufArray::U8(v) => write!(f, "{}", v[i])?,
                GgufArray::I8(v) => write!(f, "{}", v[i])?,
                GgufArray::U16(v) => write!(f, "{}", v[i])?,
                GgufArray::I16(v) => write!(f, "{}", v[i])?,
                GgufArray::U32(v) => write!(f, "{}", v[i])?,
                GgufArray::I32(v) => write!(f, "{}", v[i])?,
                GgufArray::F32(v) => write!(f, "{}", v[i])?,
                GgufArray::Bool(v) => write!(f, "{}", v[i])?,
                GgufArray::String(v) => write_short_str(f, &v[i])?,
                GgufArray::Array(v) => write!(f, "{}", v[i])?,
                GgufArray::U64(v) => write!(f, "{}", v[i])?,
                GgufArray::I64(v) => write!(f, "{}", v[i])?,
                GgufArray::F64(v) => write!(f, "{}", v[i])?,
            }
        }
        if self.len() > SHOWN {
            f.write_str(", …")?;
        }
        f.write_str("]")
    }
}
