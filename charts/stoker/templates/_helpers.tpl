{{- define "stoker.name" -}}stoker{{- end -}}

{{- define "stoker.fullname" -}}
{{- if contains "stoker" .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}{{- else -}}{{ printf "%s-stoker" .Release.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "stoker.labels" -}}
app.kubernetes.io/name: stoker
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "stoker.selector" -}}
app.kubernetes.io/name: stoker
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "stoker.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "stoker.pluginDir" -}}{{ .Values.node.kubeletDir }}/plugins/csi.stoker.dev{{- end -}}

{{- define "stoker.mounterMemory" -}}
{{- $cache := include "stoker.bytes" .Values.node.cacheMemory | int64 -}}
{{- $overhead := include "stoker.bytes" .Values.node.memoryOverhead | int64 -}}
{{- printf "%dMi" (div (add $cache $overhead) 1048576) -}}
{{- end -}}

{{/* A binary quantity (Ki, Mi, Gi, Ti) in bytes; values.schema.json restricts the forms. */}}
{{- define "stoker.bytes" -}}
{{- $q := toString . -}}
{{- if hasSuffix "Ti" $q -}}{{ mul (trimSuffix "Ti" $q | int64) 1099511627776 }}
{{- else if hasSuffix "Gi" $q -}}{{ mul (trimSuffix "Gi" $q | int64) 1073741824 }}
{{- else if hasSuffix "Mi" $q -}}{{ mul (trimSuffix "Mi" $q | int64) 1048576 }}
{{- else if hasSuffix "Ki" $q -}}{{ mul (trimSuffix "Ki" $q | int64) 1024 }}
{{- else -}}{{ $q | int64 }}{{- end -}}
{{- end -}}
